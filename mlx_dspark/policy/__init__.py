"""Policy: how many drafts each round verifies, and what that is decided from.

* :mod:`.settings` - the speculation setup from flags and ``DSPARK_*`` variables;
* :mod:`.policies` - resolving a pair's policy: threshold, Algorithm 1, adaptive;
* :mod:`.scheduler` - Algorithm 1 over a step-rate curve; :mod:`.adaptive`;
* :mod:`.costs`, :mod:`.profile`, :mod:`.roundprofile` - what a round costs here;
* :mod:`.calibration` and :mod:`.calibrate` - sequential temperature scaling of
  the confidence head, and fitting it for a pair;
* :mod:`.recording`, :mod:`.memory`, :mod:`.telemetry` - what rounds did,
  unified-memory pressure, metrics.
"""
