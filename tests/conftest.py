"""Shared pytest setup: hypothesis profile sized for 2-core CI machines."""
import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("MILLION_JAX_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    # no shrinking: a failure is reported as found (shrinking JAX tests can take minutes)
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile("ci")
