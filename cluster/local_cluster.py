"""A multi-node Ray cluster on one machine: a head, a "small-GPU" node and a "large-GPU" node
told apart by custom resources, with the Serve app deployed across them.

    .venv/bin/python cluster/local_cluster.py      # start, deploy tiny models, print placement, stop

Used by tests/test_cluster_local.py."""
from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TINY_ARGS = {"verifier": "tiny:dim=128,n_layers=4,intermediate_size=256",
             "draft": "tiny:dim=128,n_layers=4,intermediate_size=256,noise=0.05", "model_name": "tiny",
             "num_threads": 1, "adaptive": False, "max_model_len": 512, "max_seqs": 48, "num_shards": 4,
             "api_keys_env": None, "max_queue": 128, "verifier_retry_s": 45.0,
             "drafter_timeout_s": 1.0}

# drafter and verifier pools autoscale separately: the verifier on one ongoing call per replica,
# the drafter (cheap) only past 8, so a burst grows the verifier pool and leaves the drafter alone
DEPLOYMENT_OPTIONS = {
    "Drafter": {"ray_actor_options": {"num_cpus": 0, "resources": {"small_gpu": 0.5}}, "max_ongoing_requests": 8,
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8,
                                       "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 2,
                                       "metrics_interval_s": 0.5}},
    "Verifier": {"ray_actor_options": {"num_cpus": 0, "resources": {"large_gpu": 0.5}}, "max_ongoing_requests": 4,
                 # downscale_delay_s longer than a replica's start-up, so a rise is not undone before it lands
                 "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.5,
                                        "upscale_delay_s": 1, "downscale_delay_s": 20, "look_back_period_s": 2,
                                        "metrics_interval_s": 0.5}},
    "OpenAIIngress": {"ray_actor_options": {"num_cpus": 0}, "num_replicas": 1},
}


@contextmanager
def local_cluster(app_args: dict | None = None, deployment_options: dict | None = None):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_with_options

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    small = cluster.add_node(num_cpus=1, resources={"small_gpu": 2})
    large = cluster.add_node(num_cpus=1, resources={"large_gpu": 2})
    ray.init(address=cluster.address, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_with_options({**TINY_ARGS, **(app_args or {})}, deployment_options or DEPLOYMENT_OPTIONS),
                  name="specdec", route_prefix="/")
        yield {"url": f"http://127.0.0.1:{port}", "cluster": cluster, "small_node": small.node_id,
               "large_node": large.node_id, "head_node": cluster.head_node.node_id}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def replicas(name: str) -> int:
    from ray import serve

    st = serve.status().applications["specdec"].deployments[name]
    return st.replica_states.get("RUNNING", 0)


def main() -> int:
    from ray import serve

    with local_cluster() as c:
        for name in ("Drafter", "Verifier"):
            where = serve.get_deployment_handle(name, "specdec").stats.remote().result()["node_id"]
            pool = {c["small_node"]: "small-GPU node", c["large_node"]: "large-GPU node"}.get(where, where)
            print(f"{name}: {replicas(name)} replica(s) on the {pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
