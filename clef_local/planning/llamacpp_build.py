"""The llama.cpp build this machine has (llama-cpp-python compiles it at install) and how to build it for a GPU:
what ``clef-local doctor`` shows and the planner asks (does this build offload to a GPU?). docs/hardware.md#llamacpp.
"""

from __future__ import annotations

from typing import Any

PINNED = "llama-cpp-python==0.3.36"  # pyproject's gguf extra: the low-level API changes between releases
# llama.cpp's GPU backends are chosen when pip builds llama-cpp-python (an sdist): the CMake flag of each
BUILD_FLAGS = {"Metal": "-DGGML_METAL=on", "CUDA": "-DGGML_CUDA=on", "Vulkan": "-DGGML_VULKAN=on",
               "ROCm": "-DGGML_HIP=on"}


def build_command(backend: str) -> str:
    """The command that rebuilds llama-cpp-python with ``backend`` (a key of :data:`BUILD_FLAGS`)."""
    return f'CMAKE_ARGS="{BUILD_FLAGS[backend]}" pip install --force-reinstall --no-cache-dir {PINNED}'


def llama_cpp_build() -> dict[str, Any]:
    """The llama-cpp-python version, llama.cpp's CPU features (``llama_print_system_info``) and whether this build
    offloads to a GPU (imports the binding: its shared library loads)."""
    import llama_cpp

    return {"llama_cpp_python": str(llama_cpp.__version__),
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(" |"),
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload())}
