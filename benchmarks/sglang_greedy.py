"""Greedy output of the default model through SGLang with and without the kvstrata plugin.

Three steps, driven by ``benchmarks/sglang_greedy_gpu.sh``:

- ``stage OUT`` (here, on CPU): the default model's GGUF split into parts that each fit one device
  call (``OUT/p1/part1``, ...), and ``OUT/meta``: the ``gguf`` package (pure Python; the GPU image
  has none), ``config.json`` and the tokenizer files of kvstrata's converted directory, the prompts
  as token ids (the corpus is not on the GPU machine) and a manifest (the GGUF's sha256, each
  tensor's sha256);
- ``build PARTS META MODEL_DIR`` (GPU machine): joins the parts, checks the GGUF's sha256,
  dequantizes it with kvstrata's own reader into ``MODEL_DIR/model.safetensors`` (float32, as
  kvstrata's converter writes it) and checks every tensor against the manifest, so SGLang loads
  exactly the weights kvstrata's engine loads;
- ``compare PROMPTS name=port ... [--out FILE]``: sends the prompts (temperature 0, ``ignore_eos``)
  to each server, first one at a time, then all at once (the second pass finds the prompts in the
  radix cache), and prints, per server and pass, how many leading tokens of each prompt agree with
  the first server's (the baseline); ``report FILE`` prints the table again from the saved answers.
  The baseline's top-2 logprob gap at the first disagreeing token tells a near-tie from a real
  error; the mean change of that gap while the tokens still agree says how far apart the logits are.

The prompts are those of ``tests/engine/test_engine.py::test_fp8_agrees_with_unquantized``: the
first 160 tokens of the first 8 corpus paragraphs longer than 600 characters; agreement is judged
the same way (share of prompts agreeing on >= 16 tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = 8
PROMPT_TOKENS = 160
AGREE_TOKENS = 16  # as tests/engine: a prompt "agrees" when its first 16 tokens do
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_digests(state) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
        for name, t in sorted(state.items())
    }


def stage(out: Path, part_mib: list[float]) -> None:
    import gguf
    from safetensors.torch import load_file

    from kvstrata.engine.loader import converted_dir, load_tokenizer
    from kvstrata.resources import default_model_path, load_corpus_text

    source = default_model_path()
    model_dir = converted_dir(source)
    meta = out / "meta"
    shutil.rmtree(out, ignore_errors=True)
    (meta / "hf").mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "scripts")
    shutil.copytree(Path(gguf.__file__).parent, meta / "gguf", ignore=skip)
    for name in MODEL_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, meta / "hf" / name)
    data = source.read_bytes()
    sizes = [int(mib * (1 << 20)) for mib in part_mib]
    bounds = [0]
    for size in sizes:
        bounds.append(min(bounds[-1] + size, len(data)))
    bounds.append(len(data))
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False), start=1):
        (out / f"p{i}").mkdir()
        (out / f"p{i}" / f"part{i}").write_bytes(data[lo:hi])
    tok = load_tokenizer(model_dir)
    paragraphs = [p for p in load_corpus_text().split("\n\n") if len(p) > 600][:PROMPTS]
    prompts = [tok.encode(p)[:PROMPT_TOKENS] for p in paragraphs]
    (meta / "prompts.json").write_text(json.dumps(prompts))
    manifest = {
        "gguf": source.name,
        "gguf_sha256": hashlib.sha256(data).hexdigest(),
        "parts": len(bounds) - 1,
        "tensors": tensor_digests(load_file(str(model_dir / "model.safetensors"))),
    }
    (meta / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for i in range(1, len(bounds)):
        print(f"{out}/p{i}: {(out / f'p{i}' / f'part{i}').stat().st_size / (1 << 20):.1f} MiB")
    print(f"{meta}: {sum(f.stat().st_size for f in meta.rglob('*') if f.is_file()) / (1 << 20):.1f} MiB")


def build(parts_dir: Path, meta: Path, model_dir: Path) -> None:
    from safetensors.torch import save_file

    from kvstrata.engine.weights_gguf import read_gguf

    manifest = json.loads((meta / "manifest.json").read_text())
    gguf_path = parts_dir / manifest["gguf"]
    with gguf_path.open("wb") as f:
        for i in range(1, manifest["parts"] + 1):
            f.write((parts_dir / f"part{i}").read_bytes())
    got = sha256_file(gguf_path)
    if got != manifest["gguf_sha256"]:
        sys.exit(f"GGUF sha256 {got[:16]} != {manifest['gguf_sha256'][:16]}: a part is missing or broken")
    _, state, _ = read_gguf(gguf_path)
    digests = tensor_digests(state)
    bad = [name for name, d in manifest["tensors"].items() if digests.get(name) != d]
    if bad or len(digests) != len(manifest["tensors"]):
        sys.exit(f"tensors differ from kvstrata's converted model: {bad[:5]} ({len(digests)} tensors)")
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in (meta / "hf").iterdir():
        shutil.copy(f, model_dir / f.name)
    print(f"model: {len(digests)} tensors equal to kvstrata's converted model (sha256), in {model_dir}")


def generate(port: int, ids: list[int], new_tokens: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    top = out["meta_info"].get("output_top_logprobs") or []
    gaps = [(p[0][0] - p[1][0]) if p and len(p) > 1 else None for p in top]
    return {"ids": out["output_ids"], "gaps": gaps}


def run_pass(port: int, prompts: list[list[int]], new_tokens: int, concurrent: bool) -> list[dict]:
    if not concurrent:
        return [generate(port, ids, new_tokens) for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate(port, ids, new_tokens), prompts))


def agreeing(ref: list[int], got: list[int]) -> int:
    """Leading tokens on which ``got`` equals ``ref``."""
    return next(
        (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
    )


def gap_drift(ref: list[dict], got: list[dict], agree: list[int]) -> float:
    """Mean |difference| of the top-2 logprob gap over the positions where both still agree: how far
    apart the two servers' logits are, also where the chosen tokens are the same."""
    diffs = [
        abs(r["gaps"][i] - g["gaps"][i])
        for r, g, n in zip(ref, got, agree, strict=True)
        for i in range(n)
        if r["gaps"][i] is not None and g["gaps"][i] is not None
    ]
    return sum(diffs) / max(len(diffs), 1)


def compare(prompts_file: Path, servers: list[str], new_tokens: int, out: Path | None) -> int:
    prompts = json.loads(prompts_file.read_text())
    ports = {name: int(port) for name, port in (s.split("=") for s in servers)}
    passes = {"one at a time": False, "all at once": True}

    def server_run(item):
        name, port = item
        try:
            return name, {p: run_pass(port, prompts, new_tokens, c) for p, c in passes.items()}
        except (OSError, KeyError, ValueError) as exc:  # a server that died or answered an error
            return name, f"failed: {exc!r}"

    with ThreadPoolExecutor(len(ports)) as pool:
        results = dict(pool.map(server_run, ports.items()))
    if out is not None:
        out.write_text(json.dumps(results))
    return report(results, new_tokens)


def report(results: dict, new_tokens: int) -> int:
    """The agreement table of ``results`` ({server: {pass: [{"ids", "gaps"} per prompt]} or an
    error string}, the baseline first)."""
    base_name = next(iter(results))
    base = results[base_name]
    if isinstance(base, str):
        print(f"baseline {base_name} {base}")
        return 1
    prompts = len(base["one at a time"])
    print(
        f"{prompts} prompts of {PROMPT_TOKENS} tokens, {new_tokens} greedy tokens each; baseline {base_name}"
    )
    print(
        "| server | pass | prompts identical | agreeing tokens per prompt | share >= 16 "
        "| base top-2 gap at first difference | mean abs. change of top-2 gap while agreeing |"
    )
    print("|---|---|---:|---|---:|---|---:|")
    rows = [(name, p, results[name], base[p]) for name in results if name != base_name for p in base]
    rows.append((f"{base_name} (all at once vs one at a time)", "all at once", base, base["one at a time"]))
    for name, p, res, ref in rows:
        if isinstance(res, str):
            print(f"| {name} | {p} | {res} | | | | |")
            continue
        agree = [agreeing(r["ids"], g["ids"]) for r, g in zip(ref, res[p], strict=True)]
        identical = sum(n == new_tokens for n in agree)
        firsts = [r["gaps"][n] for r, n in zip(ref, agree, strict=True) if n < new_tokens]
        gaps = ", ".join(f"{g:.3g}" for g in firsts if g is not None) or "-"
        share = sum(n >= AGREE_TOKENS for n in agree) / len(agree)
        drift = gap_drift(ref, res[p], agree)
        print(f"| {name} | {p} | {identical}/{len(agree)} | {agree} | {share:.2f} | {gaps} | {drift:.3g} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage")
    p.add_argument("out", type=Path)
    p.add_argument("--part-mib", default="14,60", help="sizes of all parts but the last, MiB")
    p = sub.add_parser("build")
    p.add_argument("parts_dir", type=Path)
    p.add_argument("meta", type=Path)
    p.add_argument("model_dir", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("prompts", type=Path)
    p.add_argument("servers", nargs="+", help="name=port, the baseline first")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    p = sub.add_parser("report", help="the table again, from compare's --out file")
    p.add_argument("results", type=Path)
    p.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.cmd == "stage":
        stage(args.out, [float(x) for x in args.part_mib.split(",")])
    elif args.cmd == "build":
        build(args.parts_dir, args.meta, args.model_dir)
    elif args.cmd == "report":
        return report(json.loads(args.results.read_text()), args.new_tokens)
    else:
        return compare(args.prompts, args.servers, args.new_tokens, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
