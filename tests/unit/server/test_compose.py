"""docker-compose.yml cannot run here (no Docker engine): check that its services reference each other correctly."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from cpmemory.server.command import command

ROOT = Path(__file__).resolve().parents[3]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _flag_values(args: list[str], flag: str) -> list[str]:
    return [arg.split("=", 1)[1] for arg in args if arg.startswith(flag + "=")]


def test_services_and_their_wiring() -> None:
    services = _compose()["services"]
    assert {"redis", "proxy"} <= set(services)
    replicas = [name for name, spec in services.items() if str(spec.get("image", "")).startswith("vllm/vllm-openai")]
    assert len(replicas) == 2
    proxy_args = services["proxy"]["command"]
    engines = _flag_values(proxy_args, "--engine")
    events = _flag_values(proxy_args, "--kv-events")
    assert len(engines) == len(events) == 2
    for replica, engine_url, event_url in zip(sorted(replicas), engines, events):
        args = services[replica]["command"]
        port = _flag_values(args, "--port")[0]
        assert engine_url == f"http://{replica}:{port}"
        assert "--enable-prefix-caching" in args
        kv_config = next(arg for arg in args if arg.startswith("--kv-events-config="))
        bound = re.search(r'"endpoint": "tcp://\*:(\d+)"', kv_config)
        assert bound and event_url == f"tcp://{replica}:{bound.group(1)}"
        assert _flag_values(args, "--model")[0]
        assert services["proxy"]["depends_on"][replica]["condition"] == "service_healthy"
        devices = services[replica]["deploy"]["resources"]["reservations"]["devices"][0]
        assert "gpu" in devices["capabilities"]
    redis_url = _flag_values(proxy_args, "--redis")[0]
    assert redis_url.startswith("redis://redis:6379")
    assert "redis" in services["proxy"]["depends_on"]


def test_proxy_image_runs_the_serve_command_with_known_options() -> None:
    services = _compose()["services"]
    dockerfile = ROOT / services["proxy"]["build"]["dockerfile"]
    text = dockerfile.read_text()
    assert 'ENTRYPOINT ["cpmemory", "serve"]' in text and "[server]" in text
    # every flag the compose file passes is an option of `cpmemory serve`
    import inspect

    known = set()
    for parameter in inspect.signature(command, eval_str=True).parameters.values():
        option = parameter.default
        if hasattr(parameter.annotation, "__metadata__"):
            option = parameter.annotation.__metadata__[0]
        declared = [*option.param_decls, option.default]  # Annotated form: typer reads a "--flag" default as a name
        known.update(name for p in declared if isinstance(p, str) and p.startswith("--") for name in p.split("/"))
    for arg in services["proxy"]["command"]:
        assert arg.split("=", 1)[0] in known, arg


def test_router_variant_puts_vllm_router_between_the_proxy_and_the_replicas() -> None:
    base = _compose()["services"]
    variant = yaml.safe_load((ROOT / "docker-compose.router.yml").read_text())["services"]
    router_args = variant["vllm-router"]["command"]
    assert "--policy=kv_aware" in router_args
    replicas = sorted(name for name, spec in base.items() if str(spec.get("image", "")).startswith("vllm/vllm-openai"))
    workers = [arg for arg in router_args if arg.startswith("http://")]
    sources = _flag_values(router_args, "--kv-event-source")
    assert workers == [f"http://{name}:8000" for name in replicas]
    assert sources == [f"http://{name}:8000=tcp://{name}:5557" for name in replicas]
    served = {_flag_values(base[name]["command"], "--served-model-name")[0] for name in replicas}
    assert _flag_values(router_args, "--kv-event-model") == sorted(served)
    port = _flag_values(router_args, "--port")[0]
    proxy_args = variant["proxy"]["command"]
    assert _flag_values(proxy_args, "--upstream") == [f"http://vllm-router:{port}"]
    assert _flag_values(proxy_args, "--kv-events") == _flag_values(base["proxy"]["command"], "--kv-events")
    assert variant["proxy"]["depends_on"]["vllm-router"]["condition"] == "service_healthy"
    # kv_aware needs the replicas' /v1/chat/completions/render and unsalted requests; sessions keep conversations put
    assert all("--enable-scale-out" in [a.split()[0] for a in base[name]["command"]] for name in replicas)
    assert "--upstream-kind=vllm-router" in proxy_args  # no salt on one tenant, conversations named
    assert _flag_values(router_args, "--kv-aware-session-affinity-ttl-secs")
    assert 'ENTRYPOINT ["vllm-router"]' in (ROOT / variant["vllm-router"]["build"]["dockerfile"]).read_text()
    # every proxy flag is a `cpmemory serve` option (the base file's check, on the variant's command)
    import inspect

    known = set()
    for parameter in inspect.signature(command, eval_str=True).parameters.values():
        option = parameter.default
        if hasattr(parameter.annotation, "__metadata__"):
            option = parameter.annotation.__metadata__[0]
        known.update(name for p in [*option.param_decls, option.default] if isinstance(p, str) and p.startswith("--")
                     for name in p.split("/"))  # a boolean "--flag/--no-flag" declares both names
    assert all(arg.split("=", 1)[0] in known for arg in proxy_args)
