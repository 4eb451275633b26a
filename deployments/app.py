"""`build_app(args)`: the application builder named by serve_config.yaml's import_path."""
from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve import Application

from deployments.config import AppArgs
from deployments.ingress import OpenAIIngress
from deployments.replicas import Drafter, Verifier


def build_app(args: dict) -> Application:
    """Verifier + Drafter (for a draft model: a draft head runs in the Verifier; none for 'none')
    behind the OpenAI ingress. `serve run` calls
    it with the config's `args` (exactly one parameter: Serve checks the signature) and applies
    the file's `deployments:` section itself."""
    return build_with_options(args)


def build_with_options(args: dict | None, deployment_options: dict[str, dict] | None = None) -> Application:
    """`deployment_options` ({name: Deployment.options kwargs}) is for callers that run the app
    from Python, where no config file's `deployments:` section is applied."""
    a = AppArgs(**(args or {}))
    opts = deployment_options or {}
    kw = a.model_dump()
    drafter = Drafter.options(**opts.get("Drafter", {})).bind(kw) if a.draft != "none" and not a.draft_in_verifier \
        else None
    verifier = Verifier.options(**opts.get("Verifier", {})).bind(kw)
    return OpenAIIngress.options(**opts.get("OpenAIIngress", {})).bind(kw, drafter, verifier)


def app_from_config(path: str | Path, app: int = 0, args_override: dict | None = None) -> tuple[Application, dict]:
    """Build one application of a Serve config file the way `serve run` would (args and the
    per-deployment options), for tests and scripts that start Serve in-process."""
    cfg = yaml.safe_load(Path(path).read_text())["applications"][app]
    args = {**(cfg.get("args") or {}), **(args_override or {})}
    opts = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in cfg.get("deployments", [])}
    return build_with_options(args, opts), cfg
