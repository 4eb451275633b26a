"""Starting Ray and Serve apps from tests (one cluster per module, torn down after it)."""
import os
import random
import socket
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+): one the OS hands out (bind to 0) can be
    handed again to a Ray worker's own socket before Serve's proxy binds it, and the proxy then
    fails ("Address already in use", seen once here)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


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

    from deployments.config import AppArgs

    app, cfg = app_from_config(config, args_override=args_override)
    serve.run(app, name=name, route_prefix=route_prefix)
    args = AppArgs(**{**(cfg.get("args") or {}), **args_override})
    has_drafter = args.draft != "none" and not args.draft_in_verifier
    return serve.get_deployment_handle("Verifier", name), serve.get_deployment_handle("Drafter", name) \
        if has_drafter else None
