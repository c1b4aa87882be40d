"""jaxspec: fast long-context, high-throughput LLM decoding in JAX.

Speculative decoding with a sparse StreamingLLM draft KV (MagicDec), token-tree speculation
(SpecInfer) and shared-prefix attention (Hydragen), on pure-functional Flax models.
"""

from jaxspec.checkpoint import CheckpointError, Model, convert, load, save
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.engine import GenerationResult, generate

__version__ = "0.1.0"


def __getattr__(name):  # lazy: keep `import jaxspec` light
    if name == "Speculation":
        from jaxspec.speculative import Speculation
        return Speculation
    if name == "fetch":
        from jaxspec.fetch import fetch
        return fetch
    if name == "make_mesh":
        from jaxspec.sharding import make_mesh
        return make_mesh
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


__all__ = ["CheckpointError", "ConfigError", "GenerationResult", "Model", "ModelConfig",
           "Speculation", "convert", "fetch", "generate", "load", "save", "make_mesh"]
