"""A copy of a GGUF with another chat template: the bundled model served as a model whose
template thinks or calls tools, without another download."""

from __future__ import annotations

from pathlib import Path


def with_template(src: Path, dst: Path, template: str) -> Path:
    import gguf

    from potluck.engine.core.gguf_tools import _field_value

    reader = gguf.GGUFReader(src)
    arch = str(_field_value(reader.fields["general.architecture"]))
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "tokenizer.chat_template"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, _field_value(field), field.types[0], sub_type=sub_type)
    writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst
