"""Side-by-side comparison of zephon_torch with other loaders, all in one run.

Jobs (``--jobs``, default all):

* ``text``: JSONL -> parse -> tokenize with EOS (a 32k byte-level BPE) ->
  first-fit packing into flat 2049-token rows with per-document positions ->
  shuffle buffer 1024 -> batch 8 -> ``input_ids``/``labels``/``positions``;
* ``token``: the same from Parquet shards of the same documents, pre-tokenized
  (a ``list<int32>`` column), so without tokenization;
* ``token-rg``: the token job over the same documents laid out with more row
  groups per shard (4,608 documents per file in row groups of 1024: 5 per
  shard, where the token shards of ``token`` have 2);
* ``overhead``: records/s through 5 identity map stages over 1,000,000 small
  records (a generator chain, torchdata.nodes, Grain, zephon inline);
* ``padding``: padding % of first-fit and best-fit packers (8 bins) over the
  token stream in order: hand-written, Grain, zephon ``pack_flat`` (and its
  ``best_fit_decreasing``, windows of 4,096 documents);
* ``lengths``: token-job throughput for three document length distributions;
* ``memory``: peak memory of the text and token jobs on a corpus 10x smaller
  than ``--mb`` (1x) against the main tables (10x).

Every contender runs in a child process of its own (imports and set-up before
the clock; the clock covers the whole job, first read to last batch),
round-robin over ``--rounds`` rounds; tables show the median and min-max.
Memory is measured two ways: the peak RSS of the contender's main process
(``ru_maxrss``) and the peak PSS of its whole process tree (main process and
workers, sampled every 50 ms; PSS shares pages between the processes that map
them, so forked workers are not counted twice). All contenders of a job must
deliver the same non-pad tokens and the same token checksum; a mismatch is
printed as a ``MISMATCH`` line. The zephon contenders read the files in
order (the source's ``shuffle=False``, as every other contender does), except
``zephon-inline-shuffled``, the default source (a seeded shard, block and
sample order per pass), and the default configuration: ``zephon-inline-default``
(every source option at its default: 8 lanes, chunks of 512, shuffled; inline)
and ``zephon-default`` (the same under ``iter()``'s defaults: threads, the
default worker count); for each zephon contender the tables also give the
read amplification, ``stats()["bytes_read"]`` over the files' sizes (1.00:
every byte read once).

Run (one command; the corpus, tokenizer and shards are generated once under
``benchmarks/.data/compare``)::

    python benchmarks/compare.py --mb 100 --rounds 3 \
        --out benchmarks/results/compare-latest.json --plot performance.png

``--plot`` only (from an existing JSON): ``python benchmarks/compare.py
--from-json FILE --plot PNG``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# This checkout's zephon_torch, whatever an editable install elsewhere points to.
sys.path[:0] = [str(HERE), str(REPO)]

import _compare_data as data  # noqa: E402

JOBS = ("text", "token", "token-rg", "padding", "overhead", "memory", "lengths")
THROUGHPUT_JOBS = ("text", "token", "token-rg")
TEXT_CONTENDERS = ("tokenize_only", "handwritten", "torchdata.nodes-2", "grain", "grain-mp-2",
                   "DataLoader-2", "zephon-inline", "zephon-inline-shuffled",
                   "zephon-inline-default", "zephon-default",
                   "zephon-threads-1", "zephon-threads-2", "zephon-process-1",
                   "zephon-process-2", "zephon-lanes-2")
SCALING_CONTENDERS = ("handwritten", "torchdata.nodes-2", "zephon-inline", "zephon-threads-2",
                      "zephon-process-2")
MEMORY_CONTENDERS = ("handwritten", "zephon-inline", "zephon-inline-default", "zephon-default",
                     "zephon-threads-2", "zephon-process-2")
CHILD_TIMEOUT_S = 3600


# --------------------------------------------------------------------------- the child


class _TreeMemory:
    """Samples the PSS of this process and its descendants; keeps the peak (in MB)."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> float:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except Exception:  # a worker may exit between listing and reading
                continue
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> _TreeMemory:
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def _import_engine() -> None:
    """Import the zephon_torch modules a run imports lazily (runners, operators, sources).

    They would otherwise be imported inside the clock, which the other
    contenders' libraries are not (their set-up imports them before it).
    """
    import importlib
    import pkgutil

    import zephon_torch

    for name in ("_training", "checkpoint"):
        importlib.import_module(f"zephon_torch.{name}")
    for package in ("ops", "runners", "sources"):
        module = importlib.import_module(f"zephon_torch.{package}")
        for info in pkgutil.iter_modules(module.__path__):
            importlib.import_module(f"zephon_torch.{package}.{info.name}")
    del zephon_torch


def run_child(spec: dict[str, Any]) -> None:
    """Build one contender, time it, print one JSON line with its result."""
    # Imports are paid before the clock starts.
    import _compare_contenders as cc
    import numpy  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401

    import zephon_torch

    if Path(zephon_torch.__file__).resolve().parent.parent != REPO:
        raise SystemExit(f"imported {zephon_torch.__file__}, not this checkout's zephon_torch")
    _import_engine()
    job, name = spec["job"], spec["contender"]
    with _TreeMemory() as memory:
        if job == "overhead":
            items = [{"text": f"item {i}", "id": i} for i in range(spec["items"])]
            run = cc.overhead(name, items)
        elif job == "padding":
            run = cc.padding(name, spec["files"])
        else:
            run = cc.build(job, name, spec["files"], spec["tokenizer"])
        # The garbage of the imports and set-up is collected before the clock,
        # for every contender alike (as timeit and pyperf do): otherwise the
        # first contender code to allocate pays for a full collection of it.
        gc.collect()
        start = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - start
    if isinstance(out, int):
        out = {"records": out}
    out.update(seconds=seconds, peak_pss_mb=memory.peak,
               peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(out))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one contender in a fresh Python process; an error is returned, not raised."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    path = os.pathsep.join(p for p in (str(REPO), str(HERE), os.environ.get("PYTHONPATH"))
                           if p)
    env = {**os.environ, "PYTHONPATH": path}
    # Bytecode caches as a user has them: without them every child (and every
    # spawned worker) compiles this checkout's modules from source each time.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S, cwd=str(HERE))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- tables


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ok(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "error" not in r]


def summarize(runs: dict[str, list[dict[str, Any]]], unit: str = "tokens",
              files_bytes: int = 0) -> dict[str, dict]:
    """Per contender: median/min/max rate, memory medians, padding, counts, errors, and
    (for contenders that report ``bytes_read``) the read amplification over ``files_bytes``."""
    out = {}
    for name, rs in runs.items():
        good = _ok(rs)
        rates = [r[unit] / r["seconds"] for r in good]
        row: dict[str, Any] = {"n": len(good), "errors": [r["error"] for r in rs if "error" in r]}
        if good:
            row.update(rate=_med(rates), rate_min=min(rates), rate_max=max(rates),
                       seconds=_med([r["seconds"] for r in good]),
                       pss_mb=_med([r["peak_pss_mb"] for r in good]),
                       rss_mb=_med([r["peak_rss_mb"] for r in good]),
                       count=good[0][unit], checksum=good[0].get("checksum"))
            if good[0].get("rows"):
                row["padding_pct"] = 100.0 * (1 - good[0]["tokens"] / (good[0]["rows"]
                                                                       * data.ROW))
            read = [r["bytes_read"] for r in good if r.get("bytes_read") is not None]
            if read and files_bytes:
                row["read_amplification"] = _med(read) / files_bytes
        out[name] = row
    return out


def files_size(files: list[str]) -> int:
    """Bytes of the files on disk (the denominator of the read amplification)."""
    return sum(os.path.getsize(f) for f in files)


def check_counts(job: str, runs: dict[str, list[dict[str, Any]]], unit: str) -> list[str]:
    """MISMATCH lines when contenders delivered different counts or checksums."""
    lines = []
    counts = {n: {r[unit] for r in _ok(rs)} for n, rs in runs.items()}
    sums = {n: {r.get("checksum") for r in _ok(rs)} - {None} for n, rs in runs.items()}
    all_counts = {c for cs in counts.values() for c in cs}
    all_sums = {s for ss in sums.values() for s in ss}
    if len(all_counts) > 1:
        lines.append(f"MISMATCH ({job}): contenders delivered different {unit} counts: "
                     + ", ".join(f"{n}={sorted(c)}" for n, c in counts.items()))
    if len(all_sums) > 1:
        lines.append(f"MISMATCH ({job}): token checksums differ: "
                     + ", ".join(f"{n}={sorted(s)}" for n, s in sums.items() if s))
    return lines


def _fmt_rate(row: dict[str, Any]) -> str:
    if "rate" not in row:
        return "failed"
    scale, unit = (1e6, "M") if row["rate_min"] >= 1e5 else (1e3, "k")
    return (f"{row['rate'] / scale:.2f} {unit} ({row['rate_min'] / scale:.2f}-"
            f"{row['rate_max'] / scale:.2f})")


def throughput_table(title: str, summary: dict[str, dict], base: str, unit: str = "tokens"
                     ) -> list[str]:
    """A markdown table: rate, ratio to ``base``, memory, padding."""
    ref = summary.get(base, {}).get("rate")
    lines = [title, "",
             f"| contender | {unit}/s, median (min-max) | vs {base} | read amplification "
             "| peak PSS MB, all processes | peak RSS MB, main process | padding % |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in summary.items():
        if "rate" not in row:
            lines.append(f"| {name} | failed: {'; '.join(row['errors'])[:200]} | | | | | |")
            continue
        ratio = f"{row['rate'] / ref:.2f}x" if ref else "-"
        pad = f"{row['padding_pct']:.2f}" if "padding_pct" in row else "-"
        amp = f"{row['read_amplification']:.2f}" if "read_amplification" in row else "-"
        lines.append(f"| {name} | {_fmt_rate(row)} | {ratio} | {amp} | {row['pss_mb']:.0f} | "
                     f"{row['rss_mb']:.0f} | {pad} |")
    return lines


def _best(summary: dict[str, dict], prefix: str) -> tuple[str | None, float]:
    rated = [(row["rate"], name) for name, row in summary.items()
             if name.startswith(prefix) and "rate" in row]
    if not rated:
        return None, float("nan")
    rate, name = max(rated)
    return name, rate


def _verdict(value: float, target: float, higher: bool = True) -> str:
    if value != value:  # nan
        return "n/a"
    return "holds" if (value >= target if higher else value <= target) else "MISSED"


def target_lines(job: str, summary: dict[str, dict]) -> list[str]:
    """The issue's targets for this job, as measured ratios."""
    zname, zrate = _best(summary, "zephon")
    others = {n: r for n, r in summary.items()
              if not n.startswith("zephon") and n != "tokenize_only" and "rate" in r}
    lines = []
    if zname is None:
        return ["no zephon result"]

    def rate(name: str) -> float:
        return summary.get(name, {}).get("rate", float("nan"))

    if job == "text" and others:
        oname = max(others, key=lambda n: others[n]["rate"])
        r1, r2 = zrate / others[oname]["rate"], zrate / rate("tokenize_only")
        lines.append(f"- best zephon ({zname}) / best other ({oname}): {r1:.2f} "
                     f"(target >= 0.95: {_verdict(r1, 0.95)})")
        lines.append(f"- best zephon / tokenize_only: {r2:.2f} (target >= 0.90: "
                     f"{_verdict(r2, 0.90)})")
    if job in ("token", "token-rg"):
        _, grate = _best(summary, "grain")
        r = rate("zephon-inline") / rate("handwritten")
        lines.append(f"- zephon-inline / handwritten: {r:.2f} (target >= 0.9: "
                     f"{_verdict(r, 0.9)})")
        for label, other, target in (("handwritten", rate("handwritten"), None),
                                     ("torchdata.nodes-2", rate("torchdata.nodes-2"), 1.0),
                                     ("best grain", grate, 4.0)):
            r = zrate / other
            verdict = "" if target is None else f" (target >= {target:g}: {_verdict(r, target)})"
            lines.append(f"- best zephon ({zname}) / {label}: {r:.2f}{verdict}")
        for name in ("zephon-process-2", "zephon-lanes-2"):
            r = rate(name) / rate("zephon-inline")
            if r == r:
                lines.append(f"- {name} / zephon-inline: {r:.2f} (target >= 1: "
                             f"{_verdict(r, 1.0)})")
    inline, shuffled = summary.get("zephon-inline", {}), summary.get("zephon-inline-shuffled", {})
    if "rate" in inline and "rate" in shuffled:
        r = shuffled["rate"] / inline["rate"]
        lines.append(f"- zephon-inline-shuffled (default shuffle=True) / zephon-inline "
                     f"(shuffle=False): {r:.2f} (target >= 0.90: {_verdict(r, 0.90)})")
    for name in ("zephon-inline", "zephon-inline-shuffled", "zephon-inline-default",
                 "zephon-default"):
        amp = summary.get(name, {}).get("read_amplification")
        if amp is not None and job != "text":
            lines.append(f"- read amplification of {name}: {amp:.2f} (target <= 1.10: "
                         f"{_verdict(amp, 1.10, higher=False)})")
    hw = summary.get("handwritten", {})
    if "pss_mb" in hw:
        # The default configuration (issue 23): at most 1.2x the hand-written loop.
        for name, target in (("zephon-inline", 1.1), ("zephon-inline-default", 1.2),
                             ("zephon-default", 1.2), ("zephon-threads-1", 1.1),
                             ("zephon-threads-2", 1.1), ("zephon-process-2", 1.2)):
            row = summary.get(name, {})
            if "pss_mb" in row:
                r = row["pss_mb"] / hw["pss_mb"]
                lines.append(f"- peak PSS, {name} / handwritten: {r:.2f} (target <= "
                             f"{target:g}: {_verdict(r, target, higher=False)})")
    return lines


# --------------------------------------------------------------------------- jobs


class Runner:
    """Runs the jobs, prints the tables and keeps the JSON file current."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.doc: dict[str, Any] = {
            "config": {"mb": args.mb, "rounds": args.rounds, "items": args.items,
                       "scaling_rounds": args.scaling_rounds,
                       "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM",
                                                                "unset (library default)"),
                       "row": data.ROW, "bins": 8, "shuffle": 1024, "batch": 8,
                       "cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "jobs": {},
        }
        self.started = time.time()
        self.tokenizer = str(data.make_tokenizer())

    def save(self) -> None:
        self.doc["config"]["wall_s"] = round(time.time() - self.started, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.doc, indent=1))

    def emit(self, lines: list[str]) -> None:
        print("\n".join(lines), flush=True)
        self.doc.setdefault("markdown", []).extend([*lines, ""])

    def rounds(self, job: str, names: list[str], spec: dict[str, Any], rounds: int,
               key: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """``rounds`` round-robin rounds of ``names``; results kept under ``key``."""
        key = key or job
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        self.doc["jobs"][key] = {"runs": runs}
        for r in range(rounds):
            for name in names:
                result = child({**spec, "job": job, "contender": name})
                runs[name].append(result)
                note = result.get("error") or f"{result['seconds']:.1f} s"
                print(f"  [{key} round {r + 1}/{rounds}] {name}: {note}", flush=True)
                self.save()
        return runs

    def corpus(self, mb: float, lengths: str = "heavy") -> tuple[list[str], list[str]]:
        text = data.make_corpus(mb, lengths)
        tokens = data.make_token_shards(text, Path(self.tokenizer))
        return ([str(p) for p in data.jsonl_files(text)],
                [str(p) for p in data.parquet_files(tokens)])

    def rg_corpus(self, mb: float) -> list[str]:
        """The token shards of the ``mb`` corpus with many row groups per shard."""
        text = data.make_corpus(mb)
        return [str(p) for p in
                data.parquet_files(data.make_token_shards_rg(text, Path(self.tokenizer)))]

    def throughput_job(self, job: str) -> None:
        jsonl, parquet = self.corpus(self.args.mb)
        names = [n for n in self.args.contenders if not (job != "text" and n == "tokenize_only")]
        files = (jsonl if job == "text" else parquet if job == "token"
                 else self.rg_corpus(self.args.mb))
        runs = self.rounds("text" if job == "text" else "token", names,
                           {"files": files, "tokenizer": self.tokenizer}, self.args.rounds,
                           key=job)
        summary = summarize(runs, files_bytes=files_size(files))
        self.doc["jobs"][job]["summary"] = summary
        what = "JSONL text" if job == "text" else "Parquet tokens"
        if job == "token-rg":
            import pyarrow.parquet as pq

            groups = sum(pq.ParquetFile(f).metadata.num_row_groups for f in files)
            what += f", {groups} row groups"
        count = next((r["count"] for r in summary.values() if "count" in r), 0)
        title = (f"### {job} job: {self.args.mb:g} MB corpus ({what}, {len(files)} shard(s)), "
                 f"{count:,} non-pad tokens, median (min-max) of {self.args.rounds} rounds")
        lines = throughput_table(title, summary, "handwritten")
        lines += ["", *check_counts(job, runs, "tokens"), *target_lines(job, summary)]
        self.emit(lines)

    def overhead_job(self) -> None:
        names = ["generator", "torchdata.nodes", "grain", "zephon-inline"]
        runs = self.rounds("overhead", names, {"items": self.args.items}, self.args.rounds)
        summary = summarize(runs, unit="records")
        self.doc["jobs"]["overhead"]["summary"] = summary
        title = (f"### overhead job: {self.args.items:,} records through 5 identity map stages, "
                 f"median (min-max) of {self.args.rounds} rounds")
        lines = throughput_table(title, summary, "generator", unit="records")
        lines += ["", *check_counts("overhead", runs, "records")]
        z, t = summary.get("zephon-inline", {}), summary.get("torchdata.nodes", {})
        if "rate" in z:
            lines.append(f"- zephon inline: {z['rate']:,.0f} records/s (target >= 1,000,000: "
                         f"{_verdict(z['rate'], 1e6)})"
                         + (f"; {z['rate'] / t['rate']:.2f}x torchdata.nodes"
                            if "rate" in t else ""))
        self.emit(lines)

    def padding_job(self) -> None:
        _, parquet = self.corpus(self.args.mb)
        import _compare_contenders as cc

        runs = self.rounds("padding", list(cc.PADDING_CONTENDERS), {"files": parquet}, 1)
        summary = summarize(runs)
        self.doc["jobs"]["padding"]["summary"] = summary
        lines = [f"### padding: packers over the token stream of the {self.args.mb:g} MB corpus "
                 "in order (8 open bins, rows of 2049, documents split at 2049)", "",
                 "| packer | rows | padding % |", "| --- | --- | --- |"]
        for name, row in summary.items():
            if "count" not in row:
                lines.append(f"| {name} | failed: {'; '.join(row['errors'])[:200]} | |")
                continue
            rows = runs[name][0]["rows"]
            lines.append(f"| {name} | {rows:,} | {row['padding_pct']:.2f} |")
        lines += ["", *check_counts("padding", runs, "tokens")]
        pad = {n: r.get("padding_pct", float("nan")) for n, r in summary.items()}
        lines.append(f"- zephon first_fit {pad['zephon-first_fit']:.2f}% vs hand-written "
                     f"first_fit {pad['handwritten-first_fit']:.2f}% (target <=: "
                     f"{_verdict(pad['zephon-first_fit'], pad['handwritten-first_fit'], False)})"
                     f"; zephon best_fit {pad['zephon-best_fit']:.2f}% (target < first_fit: "
                     f"{_verdict(pad['zephon-best_fit'], pad['zephon-first_fit'] - 1e-9, False)})")
        if "zephon-best_fit_decreasing" in pad:
            bfd = pad["zephon-best_fit_decreasing"]
            lines.append(f"- zephon best_fit_decreasing {bfd:.3f}% with the default flush "
                         f"interval (target <= 0.15%: {_verdict(bfd, 0.15, False)})")
        if "zephon-first_fit-noflush" in pad:
            nf, nb = pad["zephon-first_fit-noflush"], pad["zephon-best_fit-noflush"]
            lines.append(f"- without flush sentinels (flush_every_k_chunks=10**9): zephon "
                         f"first_fit {nf:.2f}% vs hand-written first_fit "
                         f"{pad['handwritten-first_fit']:.2f}% ("
                         f"{_verdict(nf, pad['handwritten-first_fit'], False)}); best_fit "
                         f"{nb:.2f}% vs hand-written best_fit "
                         f"{pad['handwritten-best_fit']:.2f}%")
        self.emit(lines)

    def lengths_job(self) -> None:
        mb = self.args.mb / 4
        names = [n for n in SCALING_CONTENDERS if n in self.args.contenders]
        lines = [f"### scaling with document lengths: token job, {mb:g} MB of text per "
                 f"distribution, median of {self.args.scaling_rounds} round(s) "
                 "(M tokens/s; ratio to handwritten)", "",
                 "| distribution | docs > 1 row | " + " | ".join(names) + " |",
                 "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
        for dist in data.LENGTHS:
            _, parquet = self.corpus(mb, dist)
            runs = self.rounds("token", names, {"files": parquet, "tokenizer": self.tokenizer},
                               self.args.scaling_rounds, key=f"lengths-{dist}")
            summary = summarize(runs)
            self.doc["jobs"][f"lengths-{dist}"]["summary"] = summary
            mu, sigma = data.LENGTHS[dist]
            hw = summary.get("handwritten", {}).get("rate")
            cells = []
            for n in names:
                row = summary[n]
                if "rate" not in row:
                    cells.append("failed")
                    continue
                ratio = f" ({row['rate'] / hw:.2f}x)" if hw else ""
                cells.append(f"{row['rate'] / 1e6:.2f}{ratio}")
            long_docs = _long_fraction(parquet)
            lines.append(f"| {dist} (ln words ~ N({mu}, {sigma})) | {long_docs:.1%} | "
                         + " | ".join(cells) + " |")
            lines += check_counts(f"lengths-{dist}", runs, "tokens")
        self.emit(lines)

    def memory_job(self) -> None:
        small = self.args.mb / 10
        names = [n for n in MEMORY_CONTENDERS if n in self.args.contenders]
        jsonl, parquet = self.corpus(small)
        lines = [f"### memory vs corpus size: peak PSS MB (all processes) at {small:g} MB (1x) "
                 f"and {self.args.mb:g} MB (10x)", "",
                 "| job | contender | 1x | 10x | 10x / 1x |", "| --- | --- | --- | --- | --- |"]
        for job, files in (("text", jsonl), ("token", parquet)):
            runs = self.rounds(job, names, {"files": files, "tokenizer": self.tokenizer},
                               self.args.scaling_rounds, key=f"memory-{job}-1x")
            one = summarize(runs)
            big = self.doc["jobs"].get(job, {}).get("summary")
            if big is None:
                full_jsonl, full_parquet = self.corpus(self.args.mb)
                runs10 = self.rounds(job, names, {"files": full_jsonl if job == "text"
                                                  else full_parquet,
                                                  "tokenizer": self.tokenizer},
                                     self.args.scaling_rounds,
                                     key=f"memory-{job}-10x")
                big = summarize(runs10)
            for n in names:
                a, b = one.get(n, {}).get("pss_mb"), big.get(n, {}).get("pss_mb")
                if a is None or b is None:
                    lines.append(f"| {job} | {n} | {a} | {b} | - |")
                    continue
                lines.append(f"| {job} | {n} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
        lines.append("- target: zephon flat in corpus size (10x / 1x within 1.10)")
        self.emit(lines)


def _long_fraction(parquet: list[str]) -> float:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total = longer = 0
    for path in parquet:
        lengths = pc.list_value_length(pq.read_table(path, columns=["input_ids"]).column(0))
        total += len(lengths)
        longer += pc.sum(pc.greater(lengths, data.ROW)).as_py() or 0
    return longer / total if total else 0.0


# --------------------------------------------------------------------------- plot


def plot(doc: dict[str, Any], png: Path) -> None:
    """Tokens/s (median, min-max whiskers) and peak PSS per contender, text and token jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = [j for j in ("text", "token") if "summary" in doc["jobs"].get(j, {})]
    if not jobs:
        raise SystemExit("the JSON holds no text or token job to plot")
    fig, axes = plt.subplots(len(jobs), 2, figsize=(12, 3.2 + 0.32 * 11 * len(jobs)),
                             squeeze=False)
    for i, job in enumerate(jobs):
        summary = {n: r for n, r in doc["jobs"][job]["summary"].items() if "rate" in r}
        names = list(summary)
        colors = ["tab:orange" if n.startswith("zephon") else
                  "tab:gray" if n == "tokenize_only" else "tab:blue" for n in names]
        rates = [summary[n]["rate"] / 1e6 for n in names]
        err = [[r - summary[n]["rate_min"] / 1e6 for n, r in zip(names, rates)],
               [summary[n]["rate_max"] / 1e6 - r for n, r in zip(names, rates)]]
        ax = axes[i][0]
        ax.barh(names, rates, xerr=err, color=colors, capsize=3)
        ax.invert_yaxis()
        ax.set_xlabel("M tokens/s (median, min-max)")
        ax.set_title(f"{job} job: throughput")
        ax = axes[i][1]
        ax.barh(names, [summary[n]["pss_mb"] for n in names], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("peak PSS MB, all processes (median)")
        ax.set_title(f"{job} job: memory")
    cfg = doc["config"]
    fig.suptitle(f"zephon_torch vs other loaders: {cfg['mb']:g} MB corpus, "
                 f"{cfg['rounds']} rounds, {cfg['cpus']} CPUs")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"plot written to {png}")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB of JSONL")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds")
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"comma-separated subset of {','.join(JOBS)}")
    parser.add_argument("--contenders", default=",".join(TEXT_CONTENDERS),
                        help="comma-separated subset of the text/token contenders")
    parser.add_argument("--scaling-rounds", type=int, default=1,
                        help="rounds of the lengths and memory jobs")
    parser.add_argument("--items", type=int, default=1_000_000,
                        help="records of the overhead job")
    parser.add_argument("--out", default=str(HERE / "results" / "compare-latest.json"),
                        help="JSON file of the results")
    parser.add_argument("--plot", default=None, help="also write a PNG plot here")
    parser.add_argument("--from-json", default=None, help="plot an existing JSON and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    if args.from_json:
        if not args.plot:
            raise SystemExit("--from-json needs --plot PNG")
        plot(json.loads(Path(args.from_json).read_text()), Path(args.plot))
        return
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown:
        raise SystemExit(f"unknown job(s) {unknown}; choose from {list(JOBS)}")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = sorted(set(args.contenders) - set(TEXT_CONTENDERS))
    if bad:
        raise SystemExit(f"unknown contender(s) {bad}; choose from {list(TEXT_CONTENDERS)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")

    runner = Runner(args)
    for job in jobs:
        if job in THROUGHPUT_JOBS:
            runner.throughput_job(job)
        else:
            getattr(runner, f"{job}_job")()
        print(flush=True)
    runner.save()
    print(f"total wall time {time.time() - runner.started:.0f} s; results in {runner.out}")
    if args.plot:
        plot(runner.doc, Path(args.plot))


if __name__ == "__main__":
    main()
