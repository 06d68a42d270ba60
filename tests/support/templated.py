"""Copies of a GGUF with some metadata changed: the bundled model with another chat template
(a model that thinks) or a vocabulary spelled differently, without another download."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def with_metadata(src: Path, dst: Path, change: Callable[[str, object], object]) -> Path:
    """``src`` written to ``dst`` with each key's value replaced by ``change(key, value)``
    (the same value: unchanged); tensors copied as they are."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch, use_temp_file=False)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, change(field.name, field.contents()), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.asarray(t.data))
    writer.close()
    return dst


def with_template(src: Path, dst: Path, template: str) -> Path:
    """``src`` with ``template`` as its chat template (the model must have one to replace)."""
    return with_metadata(src, dst, lambda key, value: template if key == "tokenizer.chat_template" else value)
