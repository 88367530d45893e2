"""A loaded GGUF model and its vocabulary (tokenizer reads are safe from any thread)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from mesh.engine.llama.backend import backend_init, ll
from mesh.engine.llama_rules import kv_shape_from_meta
from mesh.engine.types import ModelError

__all__ = ["LlamaModel"]


class LlamaModel:
    """A loaded GGUF model and its vocabulary."""

    def __init__(
        self,
        path: str | Path,
        *,
        n_gpu_layers: int = 0,
        extra_buffers: bool = False,
        vocab_only: bool = False,
    ) -> None:
        backend_init()
        p = Path(path)
        if not p.is_file():
            raise ModelError(f"model file not found at {p}; pass --model PATH or set MESH_MODEL")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # llama.cpp's "extra" CPU buffer types (weight repacking, AMX) segfault inside
        # ggml_backend_amx_mul_mat on AMX-capable Xeons (measured on the dev machine);
        # the plain path is safe and was faster there.
        params.use_extra_bufts = extra_buffers
        params.vocab_only = vocab_only
        handle = ll.llama_model_load_from_file(str(p).encode(), params)
        if not handle:
            raise ModelError(
                f"llama.cpp could not load {p}: not a supported GGUF model "
                "(set MESH_LLAMA_VERBOSE=1 to see llama.cpp's log)"
            )
        self._handle: Any = handle
        self.path = p
        vocab = ll.llama_model_get_vocab(handle)
        self._vocab = vocab
        self.n_vocab: int = ll.llama_vocab_n_tokens(vocab)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(handle)
        self.n_swa: int = ll.llama_model_n_swa(handle)
        self.n_params: int = int(ll.llama_model_n_params(handle))
        self.bos: int = ll.llama_vocab_bos(vocab)
        self.eos: int = ll.llama_vocab_eos(vocab)
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(vocab))
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(handle, buf, ctypes.sizeof(buf))
        self.description = buf.value.decode("utf-8", "replace")
        self._pieces: dict[int, bytes] = {}

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise RuntimeError("model is closed")
        return self._handle

    @property
    def vocab(self) -> Any:
        """The native vocabulary handle (for samplers that need it, e.g. grammars)."""
        return self._vocab

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the model has no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_model_meta_val_str(self._handle, key.encode(), buf, ctypes.sizeof(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """(layers, KV heads, K and V elements per head, training context) from the GGUF
        metadata (readable from a vocabulary-only load too)."""
        return kv_shape_from_meta(self.meta)

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        """Token ids of ``text``; special tokens (``<start_of_turn>``...) are parsed."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, True)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            arr = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, True)
        return list(arr[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token renders to (special tokens render as nothing)."""
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def piece(self, token: int) -> bytes:
        """:meth:`token_bytes`, cached (the vocabulary never changes)."""
        data = self._pieces.get(token)
        if data is None:
            data = self._pieces[token] = self.token_bytes(token)
        return data

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self._vocab, token))

    def close(self) -> None:
        if self._handle is not None:
            ll.llama_model_free(self._handle)
            self._handle = None
