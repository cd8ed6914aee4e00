"""Write the demo model's tokenizer files into a folder (for GPU-box runs that borrow them).

    python scripts/gpu/demo_tokenizer.py OUT_DIR
"""
import json
import sys
import tempfile
from pathlib import Path

from codec.decode import Archive
from service.load.demo import build_demo


def main(out: Path) -> None:
    archive = build_demo(Path(tempfile.mkdtemp()), workers=2)
    with Archive.open(archive) as a:
        files = a.reader.files()
    cfg = json.loads(files["tokenizer_config.json"])
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"        # known to transformers 4.x and 5.x alike
    for key in ("backend", "is_local", "local_files_only"):
        cfg.pop(key, None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "chat_template.jinja", "special_tokens_map.json"):
        if name in files:
            (out / name).write_bytes(files[name])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
