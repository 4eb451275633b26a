"""Starting Ray and Serve apps from tests (one cluster per module, torn down after it)."""
import os
import socket
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_cluster(num_cpus=2, resources=None):
    import ray
    from ray import serve

    from deployments.ray_env import apply

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    apply()  # a quieter control plane (the env the raylet and every worker inherit)
    ray.init(num_cpus=num_cpus, resources=resources or {"small_gpu": 1, "large_gpu": 1}, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def run_app(name: str, route_prefix: str, args_override: dict, config=ROOT / "serve_config.yaml"):
    from ray import serve

    from deployments.app import app_from_config

    app, _ = app_from_config(config, args_override=args_override)
    serve.run(app, name=name, route_prefix=route_prefix)
    return serve.get_deployment_handle("Verifier", name), serve.get_deployment_handle("Drafter", name) \
        if args_override.get("draft", "default") != "none" else None
