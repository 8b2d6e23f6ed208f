class Recipe:
    pass


class DelayedScaling(Recipe):
    def __init__(self):
        self.margin, self.amax_history_len, self.amax_compute_algo = 0, 1024, "max"


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass
