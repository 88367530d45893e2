"""The llama.cpp adapter, the one package that imports ``llama_cpp``: small owners of
llama.cpp's native handles.

Each class owns one handle and frees it in ``close()`` (idempotent). Nothing here is
thread-safe: the pool calls every method that touches the context from its engine thread.
:class:`LlamaModel`'s tokenizer methods only read the vocabulary and may be called from any
thread. Importing the package loads the bindings but no model.

Modules, by concept:

* :mod:`~mesh.engine.llama.backend`: the bindings, one-time backend start, its log, the
  build's facts (GPU offload, library version);
* :mod:`~mesh.engine.llama.model`: :class:`LlamaModel`, a GGUF model and its vocabulary;
* :mod:`~mesh.engine.llama.context`: :class:`Batch` and :class:`LlamaContext` (decode,
  per-sequence cache edits, the state reads and writes of parking and the warm start);
* :mod:`~mesh.engine.llama.sampler`: :class:`Sampler` chains and :func:`make_sampler`.

What needs no ``llama_cpp`` lives beside it: the sampler seam, greedy sampling and the
redraw policy in :mod:`mesh.engine.sampling`; KV type ids, the GGUF keys of the KV shape
and the batch preconditions in :mod:`mesh.engine.llama_rules`.
"""

from mesh.engine.llama.backend import backend_init, gpu_offload_supported, library_version
from mesh.engine.llama.context import Batch, LlamaContext
from mesh.engine.llama.model import LlamaModel
from mesh.engine.llama.sampler import Sampler, make_sampler
from mesh.engine.sampling import GreedySampler, TokenSampler

__all__ = ["Batch", "GreedySampler", "LlamaContext", "LlamaModel", "Sampler", "TokenSampler",
           "backend_init", "gpu_offload_supported", "library_version", "make_sampler"]
