"""The project prefix as ``mesh serve`` builds it: template, project folder, model,
prefix size, chat format. With ``--ray`` every pool actor is handed this same prefix.

Only the model's vocabulary is loaded (no weights). When the template's default prefix
plus one session does not fit the context the model was trained for, the prefix is scaled
down to fit (an explicit ``--prefix-tokens`` is kept and checked as given).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mesh.engine.models import ResolvedModel
    from mesh.template.chat import ChatFormat
    from mesh.template.loader import Template
    from mesh.template.prefix import Prefix

__all__ = ["ProjectPrefix", "build_project_prefix"]

_CHAT_MARGIN = 256  # tokens the chat format's markup may add around the built prefix


@dataclass
class ProjectPrefix:
    template: Template
    project: Path
    model: ResolvedModel
    prefix: Prefix
    chat: ChatFormat  # resolved against the model's vocabulary
    ids: list[int] | None  # the chat prefix's token ids (when asked for)


def build_project_prefix(args: argparse.Namespace, *, want_ids: bool = False) -> ProjectPrefix:
    """Build from ``args`` (``--template``, ``--project``, ``--model``, ``--prefix-tokens``,
    ``--session-budget``); raises ValueError naming the fix."""
    from mesh.engine.llama import LlamaModel
    from mesh.engine.models import resolve_model
    from mesh.template.chat import ChatFormat
    from mesh.template.loader import default_project_dir, load_template
    from mesh.template.prefix import build_prefix

    template = load_template(args.template)
    project = Path(args.project) if args.project else default_project_dir()
    if not project.is_dir():
        raise ValueError(f"project directory not found: {project}; pass --project DIR")
    model = resolve_model(args.model)
    vocab = LlamaModel(str(model.path), vocab_only=True)
    try:
        target = args.prefix_tokens
        trained = vocab.n_ctx_train or vocab.kv_shape()[4]  # a vocab-only load reports 0
        room = trained - args.session_budget - _CHAT_MARGIN
        if target is None and 0 < room < template.manifest.prefix.target_tokens:
            # The template's default size does not fit this model's trained context: scale
            # the prefix down to fit rather than refuse.
            target = max(64, room)
            print(f"prefix: the {template.manifest.name} template's "
                  f"{template.manifest.prefix.target_tokens} tokens plus a "
                  f"{args.session_budget}-token session pass the {trained}-token "
                  f"context {model.name} was trained for; building {target} tokens "
                  "(--prefix-tokens sets it)", file=sys.stderr)
        prefix = build_prefix(template, project,
                              lambda text: len(vocab.tokenize(text, add_bos=False)),
                              target_tokens=target)
        # The model's own chat format; one that breaks the token-prefix rule falls back.
        chat = ChatFormat.from_gguf(model.path, model_name=model.name).resolve(
            lambda text: vocab.tokenize(text, add_bos=vocab.add_bos),
            lambda msg: print(msg, file=sys.stderr))
        ids = (vocab.tokenize(chat.prefix_text(prefix.text), add_bos=vocab.add_bos)
               if want_ids else None)
    finally:
        vocab.close()
    return ProjectPrefix(template, project, model, prefix, chat, ids)
