from hypothesis import HealthCheck, settings

# Every property runs at least 200 examples in CI; deadlines are off because the
# machines are shared and noisy (speed is measured by bench/, not by tests).
settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci")
