"""Generate docs/api.md from proto/ (its comments are the documentation).

    python scripts/gen_api_docs.py          # rewrite docs/api.md
    python scripts/gen_api_docs.py --check  # exit 1 if docs/api.md is not current (CI)

Reads the proto with its source info (comments) through grpc_tools' protoc, so the
page says exactly what the contract says; tests/unit/test_api_docs.py keeps it current.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto" / "millwheel" / "v1"
DOC = ROOT / "docs" / "api.md"

# FieldDescriptorProto.Type -> proto type name
SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32",
    8: "bool", 9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64",
    17: "sint32", 18: "sint64",
}


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.desc"
        include = Path(protoc.__file__).parent / "_proto"
        protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", "--include_source_info",
                f"--descriptor_set_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("gen_api_docs: protoc failed")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comment(comments: dict[tuple[int, ...], str], path: tuple[int, ...]) -> str:
    """The element's comment on one line, as Markdown text that also fits in a table
    cell: a ``|`` would end the cell and ``<name>`` would vanish as an HTML tag."""
    text = " ".join(comments.get(path, "").split())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;")


def _type(field: descriptor_pb2.FieldDescriptorProto, maps: dict[str, str]) -> str:
    if field.type_name:
        name = field.type_name.rsplit(".", 1)[-1]
        if field.type_name in maps:
            return maps[field.type_name]
    else:
        name = SCALARS.get(field.type, str(field.type))
    if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
        return f"repeated {name}"
    if field.proto3_optional:
        return f"optional {name}"
    return name


def render(fds: descriptor_pb2.FileDescriptorSet) -> str:
    lines = ["# The gRPC API (`millwheel.v1`)", "",
             "Generated from `proto/millwheel/v1/*.proto` by `scripts/gen_api_docs.py`; do not edit.",
             "Every server also serves gRPC health checking and server reflection (v1 and v1alpha),",
             "with these comments in the descriptors it serves.", ""]
    for fdp in fds.file:
        comments: dict[tuple[int, ...], str] = {}
        for loc in fdp.source_code_info.location:
            text = "\n".join(t for t in (loc.leading_comments.strip(), loc.trailing_comments.strip()) if t)
            if text:
                comments[tuple(loc.path)] = text
        maps: dict[str, str] = {}
        for msg in fdp.message_type:
            for nested in msg.nested_type:
                if nested.options.map_entry:
                    k, v = nested.field
                    maps[f".{fdp.package}.{msg.name}.{nested.name}"] = \
                        f"map<{SCALARS.get(k.type, '?')}, {_type(v, {})}>"
        lines += ["## Services", ""]
        for si, svc in enumerate(fdp.service):
            lines += [f"### `{svc.name}`", "", _comment(comments, (6, si)) or "(undocumented)", "",
                      "| RPC | request | response | what it does |", "|---|---|---|---|"]
            for mi, m in enumerate(svc.method):
                req = ("stream " if m.client_streaming else "") + m.input_type.rsplit(".", 1)[-1]
                resp = ("stream " if m.server_streaming else "") + m.output_type.rsplit(".", 1)[-1]
                lines.append(f"| `{m.name}` | `{req}` | `{resp}` | {_comment(comments, (6, si, 2, mi))} |")
            lines.append("")
        lines += ["## Messages", ""]
        for i, msg in enumerate(fdp.message_type):
            lines += [f"### `{msg.name}`", ""]
            doc = _comment(comments, (4, i))
            if doc:
                lines += [doc, ""]
            if msg.field:
                lines += ["| field | type | # | meaning |", "|---|---|---|---|"]
                for j, f in enumerate(msg.field):
                    lines.append(f"| `{f.name}` | `{_type(f, maps)}` | {f.number} | "
                                 f"{_comment(comments, (4, i, 2, j))} |")
                lines.append("")
            for ei, enum in enumerate(msg.enum_type):
                doc = _comment(comments, (4, i, 4, ei))
                lines += [f"Enum `{msg.name}.{enum.name}`" + (f": {doc}" if doc else ""), ""]
                lines += [f"- `{v.name}` ({v.number}) {_comment(comments, (4, i, 4, ei, 2, vi))}".rstrip()
                          for vi, v in enumerate(enum.value)]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def undocumented(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Every service, RPC, message and field without a comment."""
    missing = []
    for fdp in fds.file:
        has = {tuple(loc.path) for loc in fdp.source_code_info.location
               if (loc.leading_comments + loc.trailing_comments).strip()}
        for si, svc in enumerate(fdp.service):
            if (6, si) not in has:
                missing.append(f"service {svc.name}")
            missing += [f"rpc {svc.name}.{m.name}" for mi, m in enumerate(svc.method) if (6, si, 2, mi) not in has]
        for i, msg in enumerate(fdp.message_type):
            if (4, i) not in has:
                missing.append(f"message {msg.name}")
            missing += [f"field {msg.name}.{f.name}" for j, f in enumerate(msg.field) if (4, i, 2, j) not in has]
    return missing


def main(argv: list[str]) -> int:
    text = render(descriptor_set())
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} is not current: run python scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
