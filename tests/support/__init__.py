"""What the tests use besides fixtures and helpers (tests/conftest.py, tests/helpers.py):

* ``bench_mock.py``: runs benchmarks/bench.py on the CPU with CUDA timing, TE and graphs
  stood in for (test_bench_script.py starts it as a script).
* ``compile_cases.py``: a graph-counting compile backend and routings (test_compile*.py, ...).
* ``fake_te/``: a fake Transformer Engine with TE's names and signatures, and
  ``fake_te/run_te_fp8.py``, te_fp8's plumbing over it (test_te_fp8_fake.py runs it as a script).
* ``graphs_subprocess.py``: CUDA graph cases that need a process of their own (test_graphs_gpu.py).
* ``megatron_steps.py``: Megatron-Core's TEGroupedMLP driven through training steps
  (test_megatron.py, test_megatron_gpu.py).
* ``rank_cases.py``: cases run in every rank of one gloo launch, each reported as its own test
  (test_distributed_overlap.py).
* ``planted_bugs.py``: plants six realistic bugs one at a time and runs the suite against each
  (``python tests/support/planted_bugs.py``); not a test module.
* ``mutation_equivalents.md``: the surviving mutants of ``bash .ci/mutation``, and why each is
  equivalent.
"""
