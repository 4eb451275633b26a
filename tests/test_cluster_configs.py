"""The cluster and Serve configs parse, name what they must, and every deployment can be placed."""
from pathlib import Path

import pytest
import yaml

from deployments.config import AppArgs

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIGS = [ROOT / "serve_config.yaml", ROOT / "cluster" / "serve_config.gpu.yaml"]


def serve_apps(cfg: dict) -> list[dict]:
    assert cfg["applications"], "no applications"
    return cfg["applications"]


def check_app(app: dict) -> dict[str, dict]:
    module, _, attr = app["import_path"].partition(":")
    assert module == "deployments.app" and attr == "build_app"
    args = AppArgs(**app["args"])  # every arg known and valid
    deps = {d["name"]: d for d in app["deployments"]}
    # a Drafter pool serves a draft model; a draft head runs in the Verifier replicas
    drafter = args.draft != "none" and not args.draft_in_verifier
    assert set(deps) == {"Verifier", "OpenAIIngress"} | ({"Drafter"} if drafter else set())
    return deps


def demand(dep: dict) -> dict[str, float]:
    """Resources one replica asks for, in Ray's names."""
    o = dep.get("ray_actor_options", {})
    need = {"CPU": o.get("num_cpus", 1), "GPU": o.get("num_gpus", 0), **o.get("resources", {})}
    if o.get("accelerator_type"):
        need[f"accelerator_type:{o['accelerator_type']}"] = 0.001
    return {k: v for k, v in need.items() if v}


def satisfiable(need: dict, nodes: dict[str, dict]) -> list[str]:
    return [n for n, have in nodes.items() if all(have.get(k, 0) >= v for k, v in need.items())]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_configs_valid(path):
    for app in serve_apps(yaml.safe_load(path.read_text())):
        deps = check_app(app)
        for name in {"Drafter", "Verifier"} & set(deps):
            assert "autoscaling_config" in deps[name] or "num_replicas" in deps[name]


def test_local_config_places_pools_on_custom_resources():
    deps = check_app(serve_apps(yaml.safe_load(SERVE_CONFIGS[0].read_text()))[0])
    assert "Drafter" not in deps and "large_gpu" in demand(deps["Verifier"])  # the draft head drafts there
    local = {"this machine": {"CPU": 2, "small_gpu": 1, "large_gpu": 1}}  # what scripts/serve provides
    for d in deps.values():
        assert satisfiable(demand(d), local)


def test_ray_up_config_has_three_pools_that_fit_the_gpu_serve_config():
    c = yaml.safe_load((ROOT / "cluster" / "ray-cluster.aws.yaml").read_text())
    types = c["available_node_types"]
    assert c["head_node_type"] in types and len(types) >= 3
    for t in types.values():
        assert {"node_config", "resources", "min_workers", "max_workers"} <= set(t)
        assert t["min_workers"] <= t["max_workers"]
    nodes = {n: t["resources"] for n, t in types.items()}
    deps = check_app(yaml.safe_load(SERVE_CONFIGS[1].read_text())["applications"][0])
    assert satisfiable(demand(deps["Drafter"]), nodes) == ["small_gpu_workers"]
    assert satisfiable(demand(deps["Verifier"]), nodes) == ["large_gpu_workers"]
    assert satisfiable(demand(deps["OpenAIIngress"]), nodes)


def test_rayservice_manifest():
    import json

    m = yaml.safe_load((ROOT / "cluster" / "rayservice.yaml").read_text())
    assert m["kind"] == "RayService" and m["apiVersion"].startswith("ray.io/")
    rc = m["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    nodes = {}
    for g in rc["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        p = g["rayStartParams"]
        cpu = g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
        nodes[g["groupName"]] = {"CPU": float(cpu), "GPU": float(p.get("num-gpus", 0)),
                                 **json.loads(json.loads(p["resources"]))}
    serve_cfg = yaml.safe_load(m["spec"]["serveConfigV2"])
    deps = check_app(serve_apps(serve_cfg)[0])
    assert satisfiable(demand(deps["Drafter"]), nodes) == ["small-gpu"]
    assert satisfiable(demand(deps["Verifier"]), nodes) == ["large-gpu"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_the_builder_is_what_serve_run_accepts(path):
    """`serve run` calls import_path's builder through this check (exactly one parameter, the
    args dict) before anything starts; a second, optional parameter once made it refuse the app."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from deployments.app import build_app

    for app in serve_apps(yaml.safe_load(path.read_text())):
        assert isinstance(call_user_app_builder_with_args_if_necessary(build_app, app["args"]), Application)


def test_adaptive_options_name_adaptive_k_settings():
    """`adaptive_options` reaches AdaptiveK's settings; a misspelt one fails at load, not silently."""
    assert AppArgs(adaptive_options={"first_probe_k": 2, "min_gain": 0.05}).adaptive_options["min_gain"] == 0.05
    with pytest.raises(ValueError, match="unknown adaptive option"):
        AppArgs(adaptive_options={"min_gian": 0.05})
    with pytest.raises(ValueError, match="unknown adaptive option"):  # follows decode_steps, not a choice
        AppArgs(adaptive_options={"multi_step": False})
