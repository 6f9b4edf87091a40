"""The target's processed distribution (temperature, top-p, top-k, min-p, XTC)
and the draws ``mlx_lm.generate`` makes from it, reproduced key for key."""
