class FP8GlobalStateManager:
    @classmethod
    def reset(cls):
        pass


def check_fp8_support():
    return True, ""


def check_fp8_block_scaling_support():
    return True, ""
