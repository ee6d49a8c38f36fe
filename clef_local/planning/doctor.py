"""``clef-local doctor``: this machine's hardware, which backends are installed (and the extra that adds each), the
inference threads clef-local will use, and how it keeps runs offline here (namespace or in-process guard).

    clef-local doctor
    clef-local doctor --json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Component:
    """One optional piece: what it is for, whether it is installed, and how to add it."""

    name: str  # distribution name
    purpose: str
    extra: str | None  # the pyproject extra that installs it (None: a core dependency)
    installed: bool
    version: str | None = None
    detail: str = ""

    @property
    def install(self) -> str:
        if self.name == "onnxruntime-gpu":
            return "pip install onnxruntime-gpu (instead of onnxruntime, on a CUDA machine)"
        return f"pip install 'clef-local[{self.extra}]'" if self.extra else f"pip install {self.name}"


# (distribution, import name, purpose, extra)
COMPONENTS = (
    ("torch", "torch", "torch backend (CPU, CUDA)", None),
    ("transformers", "transformers", "backbone definitions for the torch backend", None),
    ("bitsandbytes", "bitsandbytes", "nf4 variants, LLM.int8 on CUDA", "cuda"),
    ("mlx", "mlx", "MLX backend (Apple silicon; Linux CPU build for tests)", "mlx"),
    ("mlx-lm", "mlx_lm", "MLX model definitions (llama, qwen3_5)", "mlx"),
    ("onnxruntime", "onnxruntime", "ONNX Runtime backend (CPU)", "onnx"),
    ("onnxruntime-gpu", "onnxruntime", "ONNX Runtime with CUDA providers", None),
    ("onnx", "onnx", "ONNX export (clef-local export-onnx)", "onnx"),
    ("llama-cpp-python", "llama_cpp", "llama.cpp backend and GGUF quantizer (export-gguf, --backend llamacpp)", "gguf"),
    ("gradio", "gradio", "desktop UI (clef-local ui)", "ui"),
    ("fastapi", "fastapi", "HTTP server (clef-local serve)", "serve"),
    ("uvicorn", "uvicorn", "HTTP server (clef-local serve)", "serve"),
    ("matplotlib", "matplotlib", "reliability diagrams (clef-local report)", "report"),
    ("pillow", "PIL", "images in requests (decoding; transformers' PIL image processor)", None),
    ("torchvision", "torchvision", "video frames in requests (Qwen3-VL's video processor); images need no extra",
     "video"),
)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _detail(distribution: str) -> str:
    """A short probe of an installed component (imports it: doctor is the place for that)."""
    try:
        if distribution == "torch":
            import torch

            parts = [f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"]
            if torch.cuda.is_available():
                parts.append(f"{torch.cuda.device_count()} GPU(s)")
            if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
                parts.append("MPS available")
            return ", ".join(parts)
        if distribution in ("onnxruntime", "onnxruntime-gpu"):
            import onnxruntime

            return "providers: " + ", ".join(onnxruntime.get_available_providers())
        if distribution == "llama-cpp-python":
            from clef_local.planning.llamacpp_build import llama_cpp_build

            build = llama_cpp_build()
            return f"GPU offload {'yes' if build['gpu_offload'] else 'no (a CPU build)'}"
        if distribution == "mlx":
            import mlx.core as mx

            return f"default device {mx.default_device()}"
        if distribution == "torchvision":
            import torchvision  # noqa: F401  (PyPI's build fails here beside the CPU torch wheel)

            return "imports"
    except (ImportError, RuntimeError, OSError) as exc:  # a broken install says so instead of failing doctor
        return f"installed but fails to import: {exc}"
    return ""


def components(probe: bool = True) -> list[Component]:
    """Every optional component with its installed state (``probe``: import installed ones for details)."""
    out = []
    for distribution, module, purpose, extra in COMPONENTS:
        version = _version(distribution)
        installed = version is not None and importlib.util.find_spec(module) is not None
        detail = _detail(distribution) if installed and probe else ""
        out.append(Component(distribution, purpose, extra, installed, version, detail))
    return out


def network_isolation() -> dict[str, Any]:
    """How ``decide``/``eval``/``drift``/``calibrate`` keep offline on this machine: their own network namespace when
    the kernel allows it (tried for real in a child process), else the in-process guard alone; ``serve`` always uses
    the guard alone (its clients are outside any namespace)."""
    from clef_local.airgap import NAMESPACE_COMMANDS, namespace_support

    support = namespace_support()
    commands = sorted(NAMESPACE_COMMANDS)
    mode = "off (namespace)" if support["available"] else "off (guard)"
    return {"namespace": bool(support["available"]), "why_not": support.get("why_not"),
            "kind": support.get("kind"), "commands": {**{c: mode for c in commands}, "serve": "off (guard)"}}


def _videos(parts: list[Component], probe: bool) -> str:
    """Whether video frames are accepted here (torchvision imports beside this torch)."""
    vision = next(c for c in parts if c.name == "torchvision")
    if not vision.installed:
        return f"refused: torchvision is not installed; {vision.install}"
    if not probe:
        return "torchvision installed (not probed: run doctor without --no-probe)"
    from clef_local.runtime.processor import video_unavailable

    reason = video_unavailable()
    return f"refused: {reason}" if reason else "accepted"


def llama_cpp_report(probe: bool = True) -> dict[str, Any]:
    """llama.cpp's build here: the binding's version, llama.cpp's CPU features (``llama_print_system_info``), whether
    it offloads to a GPU, and the command that rebuilds it for each GPU backend (docs/hardware.md#llamacpp)."""
    from clef_local.planning.llamacpp_build import BUILD_FLAGS, build_command, llama_cpp_build

    builds = {name: build_command(name) for name in BUILD_FLAGS}
    version = _version("llama-cpp-python")
    if version is None or importlib.util.find_spec("llama_cpp") is None:
        return {"installed": False, "install": "pip install 'clef-local[gguf]' (builds llama.cpp for this CPU)",
                "builds": builds}
    if not probe:
        return {"installed": True, "version": version, "builds": builds}
    try:
        build = llama_cpp_build()
    except (OSError, RuntimeError) as exc:  # the shared library does not load (a build for another CPU or GPU)
        return {"installed": True, "version": version, "error": f"fails to load: {exc}", "builds": builds}
    return {"installed": True, "version": version, "cpu_features": build["system_info"],
            "gpu_offload": build["gpu_offload"], "builds": builds}


def report(probe: bool = True) -> dict[str, Any]:
    """Hardware, components, the backends the loader can use, what ``auto`` would pick here, the inference threads
    of each role (:func:`~clef_local.planning.hardware.thread_plan`: one-shot commands and the server) and the
    network isolation (:func:`network_isolation`)."""
    from clef_local.planning.census import FORMATS
    from clef_local.planning.choice import choose, installed_backends
    from clef_local.planning.hardware import ROLES, detect, thread_plan

    hardware = detect(measure_bf16=probe)  # the one-off bf16 measurement is a probe too (about a second, cached)
    backends = installed_backends()
    bnb = importlib.util.find_spec("bitsandbytes") is not None
    auto: dict[str, Any] = {}
    for scheme in FORMATS:
        try:
            auto[scheme] = choose(hardware, scheme, installed=backends, bitsandbytes=bnb).to_json()
        except ValueError as exc:  # ApiUsageError: no backend for this scheme here
            auto[scheme] = {"error": str(exc)}
    parts = components(probe)
    media = {"images": "accepted (torch backend, a release with a vision tower)", "videos": _videos(parts, probe)}
    return {"hardware": hardware.to_json(), "hardware_summary": hardware.summary(),
            "backends": {name: {"available": why is None, "why_not": why} for name, why in backends.items()},
            "components": [asdict(c) | {"install": c.install} for c in parts], "media": media, "auto": auto,
            "threads": {role: thread_plan(workers=1, role=role).to_json() for role in ROLES},
            "network": network_isolation(),
            "state_cache": state_cache_support(), "llama_cpp": llama_cpp_report(probe)}


def state_cache_support() -> dict[str, str]:
    """Which backends keep a state cache (:mod:`clef_local.runtime.state_cache`), and why the others do not."""
    from clef_local.planning.choice import BACKENDS, STATE_CACHE_BACKENDS

    why_not = {
        "mlx": "torch only: the MLX backend runs every state in full (mlx-lm's prompt caches are not wired to it)",
        "onnx": "torch only: the ONNX export has no past key/value inputs, so ONNX Runtime runs every state in full",
        "llamacpp": "torch only: the llama.cpp backend clears its context's memory and runs every state in full",
    }
    return {name: "yes" if name in STATE_CACHE_BACKENDS else why_not.get(name, "torch only")
            for name in BACKENDS}


def render(info: dict[str, Any]) -> str:
    hw = info["hardware"]
    lines = ["hardware", f"  {info['hardware_summary']}"]
    if hw["kind"] != "cpu":
        lines.append(f"  host: {hw['host_total_bytes'] / 2**30:.1f} GiB RAM ({hw['host_free_bytes'] / 2**30:.1f} free)")
    if hw["cpu_flags"]:
        lines.append(f"  cpu flags: {' '.join(hw['cpu_flags'])}")
    if hw["kind"] == "cpu":
        speed = hw["bf16_speedup"]
        lines.append("  bf16 probe: " + (f"bf16 runs {speed:.2f}x float32's speed here; auto picks "
                                          f"{'bfloat16' if hw['fast_bf16'] else 'float32'}" if speed is not None
                                          else "not measured (needs torch); auto picks float32"))
    lines += [f"  note: {n}" for n in hw["notes"]]
    lines += ["", "backends"]
    for name, state in info["backends"].items():
        lines.append(f"  {name:<8} {'available' if state['available'] else 'not available: ' + state['why_not']}")
    lines += ["", "state cache (a second schema on the same state runs only its own tokens)"]
    for name, support in info["state_cache"].items():
        lines.append(f"  {name:<8} {support}")
    lines += ["", "components"]
    for c in info["components"]:
        state = f"installed {c['version']}" + (f" ({c['detail']})" if c["detail"] else "") if c["installed"] \
            else f"not installed: {c['install']}"
        lines.append(f"  {c['name']:<16} {state}  [{c['purpose']}]")
    lines += ["", "media", *(f"  {kind:<6} {state}" for kind, state in info["media"].items())]
    lines += ["", "auto would run (clef_local.load(path)):"]
    for scheme, choice in info["auto"].items():
        text = choice.get("error") or (f"{choice['backend']} on {choice['device']}, {choice['dtype']}, kernel "
                                       f"{choice['kernel']}")
        lines.append(f"  {scheme:<5} {text}")
    lines.append("  gguf  llamacpp, the only backend that runs a GGUF release (clef-local export-gguf)")
    lines += ["", *render_llama_cpp(info["llama_cpp"])]
    lines += ["", "threads (torch's intra-op threads, ONNX Runtime sessions)",
              f"  one-shot commands (decide, quantize, eval, drift, calibrate, batch, ...): "
              f"{info['threads']['command']['summary']}",
              f"  serve, ui, --ray drivers, the Python API's ONNX sessions: {info['threads']['server']['summary']}"]
    net = info["network"]
    lines += ["", "network (air-gapped by default; --allow-network lifts it)"]
    if net["namespace"]:
        lines.append(f"  {', '.join(c for c, m in net['commands'].items() if m == 'off (namespace)')}: off "
                     f"(namespace): each run in its own {net['kind']}, loopback only")
    else:
        lines.append(f"  no network namespace here ({net['why_not']}): every command runs with the in-process "
                     "guard alone, off (guard)")
    lines.append("  serve: off (guard): its clients are outside any namespace, so it keeps the host's network and "
                 "refuses non-loopback traffic in-process")
    return "\n".join(lines)


def render_llama_cpp(llama: dict[str, Any]) -> list[str]:
    """The llama.cpp lines of the report: its build, CPU features, GPU offload, how to build it for a GPU."""
    lines = ["llama.cpp (GGUF: --backend llamacpp, clef-local export-gguf)"]
    if not llama["installed"]:
        lines.append(f"  not installed: {llama['install']}")
    elif "error" in llama:
        lines.append(f"  llama-cpp-python {llama['version']} {llama['error']}")
    elif "cpu_features" not in llama:
        lines.append(f"  llama-cpp-python {llama['version']} (not probed: run doctor without --no-probe)")
    else:
        lines += [f"  llama-cpp-python {llama['version']}; GPU offload: "
                  + ("yes" if llama["gpu_offload"] else "no (a CPU build)"),
                  f"  {llama['cpu_features']}"]
    lines.append("  build it for a GPU (pip compiles llama.cpp, minutes):")
    lines += [f"    {name + ':':<8} {command}" for name, command in llama["builds"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``clef-local doctor``: print the report (``--json`` for JSON)."""
    parser = argparse.ArgumentParser(prog="clef-local doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--no-probe", action="store_true", help="do not import installed packages for details")
    args = parser.parse_args(argv)
    info = report(probe=not args.no_probe)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
