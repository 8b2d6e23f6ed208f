"""TE's checkpoint compatibility between a grouped layer's two layouts (E per-expert tensors
``{key}0..{key}{E-1}`` or one stacked ``key``): what :class:`functional_dw.nn.GroupedLinear`'s
loading and :func:`functional_dw.nn.remap_layouts` convert, and why a state dict cannot be."""

from __future__ import annotations

import torch

__all__ = ["layout_problem", "remap_layout"]


def layout_problem(state_dict: dict, key: str, E: int, single: bool, shape: tuple[int, ...]) -> str | None:
    """Why the other layout's keys in ``state_dict`` cannot become this layout's ``key``
    (:func:`remap_layout`), naming each bad key: an expert's ``{key}{e}`` missing or not of
    ``shape`` (one expert's), or a stacked ``key`` not of ``(E, *shape)``. None when there is
    nothing to convert, or it converts."""
    each, full = [f"{key}{e}" for e in range(E)], (E, *shape)

    def fits(k: str, want: tuple[int, ...]) -> bool:
        return isinstance(state_dict.get(k), torch.Tensor) and tuple(state_dict[k].shape) == want

    def held(k: str) -> str:
        v = state_dict[k]
        return f"has shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"is a {type(v).__name__}"

    if single and key not in state_dict and any(k in state_dict for k in each):
        bad = [f"{k} {held(k) if k in state_dict else 'is missing'}" for k in each if not fits(k, shape)]
        if bad:
            return (
                f"cannot stack the per-expert {each[0]}..{each[-1]} into {key} of shape {full}: "
                f"{', '.join(bad)}; each expert's shape is {shape}"
            )
    elif not single and key in state_dict and not any(k in state_dict for k in each) and not fits(key, full):
        return (
            f"cannot split {key} into the per-expert {each[0]}..{each[-1]}: {key} {held(key)}, "
            f"expected {full} ({E} experts of shape {shape})"
        )
    return None


def remap_layout(state_dict: dict, key: str, E: int, single: bool) -> None:
    """TE's checkpoint compatibility between layouts: ``{key}0..`` stacked into ``key`` for the
    single layout, ``key`` ([E, ...]) split into ``{key}0..`` for the per-expert one. Anything
    else is left as it is, for ``load_state_dict`` to report."""
    each = [f"{key}{e}" for e in range(E)]
    if single and key not in state_dict and all(k in state_dict for k in each):
        parts = [state_dict[k] for k in each]
        if all(isinstance(t, torch.Tensor) and t.shape == parts[0].shape for t in parts):
            for k in each:
                del state_dict[k]
            state_dict[key] = torch.stack(parts)
    elif not single and key in state_dict and not any(k in state_dict for k in each):
        t = state_dict[key]
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == E:
            state_dict.update(zip(each, state_dict.pop(key).unbind(0)))
