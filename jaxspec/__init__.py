"""jaxspec: fast long-context, high-throughput LLM decoding in JAX.

Speculative decoding with a sparse StreamingLLM draft KV (MagicDec), token-tree speculation
(SpecInfer) and shared-prefix attention (Hydragen), on pure-functional Flax models.
"""

from jaxspec.checkpoint import CheckpointError, convert, load, save
from jaxspec.config import ConfigError, ModelConfig
from jaxspec.engine import generate
from jaxspec.mesh import make_mesh
from jaxspec.model import Model
from jaxspec.session import Decoder, GenerationResult
from jaxspec.speculation import Speculation

__version__ = "0.1.0"

# the key of kept executables names the code imported now (files edited later do not count)
from jaxspec import compile_cache as _compile_cache  # noqa: E402

_compile_cache._source_hash()


def __getattr__(name):  # lazy: keep `import jaxspec` light
    if name == "fetch":
        from jaxspec.fetch import fetch
        return fetch
    raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")


__all__ = ["CheckpointError", "ConfigError", "Decoder", "GenerationResult", "Model",
           "ModelConfig", "Speculation", "convert", "fetch", "generate", "load", "save",
           "make_mesh"]
