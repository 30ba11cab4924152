import os

from hypothesis import HealthCheck, settings

# Every property runs at least 200 examples in CI; deadlines are off because the
# machines are shared and noisy (speed is measured by bench/, not by tests).
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# `HYPOTHESIS_PROFILE=long python -m pytest props`: the same properties for minutes
# (the executor's state machine runs 5,000 sequences of up to 60 calls).
settings.register_profile(
    "long",
    max_examples=5000,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# `env HYPOTHESIS_PROFILE=mutation mutmut run`: fewer examples per mutant (README, "Developing").
settings.register_profile(
    "mutation", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
