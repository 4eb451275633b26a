"""A quieter Ray control plane for small machines, as environment variables set before Ray starts.

On a 2-core CPU box every periodic wake-up of Ray's own processes (Serve's controller loop and
metrics export every 100 ms, the raylet's resource reports, task-event and metrics reports,
the memory monitor, prestarted idle workers) preempts one of the verifier's two compute threads,
and the other then waits for it at the next barrier. Measured here (SmolLM2, 1-token pass, in
the same process as the driver): 36 ms with no Ray, 46 ms with the app up and idle, 40 ms with
the app up and these settings. Each only slows how fast Ray notices or reports something (at
most ~1 s here; Serve reconciles once a second instead of ten times), so it is safe to keep on
bigger machines too, where it simply matters less.

    eval "$(python -m deployments.ray_env)"     # what scripts/serve does before `serve run`
"""
from __future__ import annotations

import os

QUIET = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",  # controller reconcile loop (default 0.1 s)
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",  # each replica's metrics export (default 100 ms)
    "RAY_enable_worker_prestart": "0",  # no idle workers started ahead of need
    "RAY_prestart_worker_first_driver": "0",
    "RAY_metrics_report_interval_ms": "30000",  # Ray's own metrics (our /metrics is the ingress's)
    "RAY_task_events_report_interval_ms": "10000",  # task events for the dashboard's state API
    "RAY_raylet_report_resources_period_milliseconds": "1000",  # raylet -> GCS resource reports (default 100)
    "RAY_memory_monitor_refresh_ms": "1000",  # OOM monitor's polling (default 250)
    # workers at normal priority: Ray's default 15 keeps its daemons responsive, which the
    # settings above make lighter, and would put the model replicas below any other process
    "RAY_worker_niceness": "0",
}


def apply() -> None:
    """Set each variable unless the environment already has it (call before ray.init)."""
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)


if __name__ == "__main__":
    for k, v in QUIET.items():
        print(f'export {k}="${{{k}:-{v}}}"')
