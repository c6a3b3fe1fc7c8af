#!/usr/bin/env python3
"""Lists the library's error sites that `cargo test --release` never reaches.

An error site is a line of `src/` outside a `#[cfg(test)]` module that raises an error:
`bail!`, `Error::Msg(…)`, `Error::msg(…)` or `Err(…Error…)`. The script builds the tests
with LLVM's source-based coverage (`-C instrument-coverage`), runs them, and prints each
site whose line (or one of the next four, for a message split over lines) never ran.
Sites that only a non-CPU device or a bug inside the crate can reach stay on the list;
the README's "Error paths" section says which those are.

Needs `llvm-profdata` and `llvm-cov` recent enough to read rustc's profiles; Debian's
`llvm-19` package reads those of rustc 1.95 (LLVM 22). Not run by CI: it builds the
whole test suite a second time, instrumented, in its own target folder (about 7 minutes
on 2 cores the first time, 3 minutes after).

    python3 scripts/error_paths.py [--llvm-suffix -19] [--out /tmp/candle-attention-cov]

Exits 0 and prints the unreached sites; exit status 1 means a step failed.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = re.compile(r"bail!|Error::Msg\(|Error::msg\(|Err\(candle::Error|Err\(Error::")


def run(cmd, env=None, capture=False):
    line = " ".join(cmd)
    print("+", line if len(line) < 300 else line[:300] + " …", file=sys.stderr)
    # Without capture, the command's output goes to stderr, so stdout holds only the list.
    out = subprocess.PIPE if capture else sys.stderr
    r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.PIPE if capture else None, text=True)
    if r.returncode:
        if capture:
            sys.stderr.write(r.stderr[-4000:])
        sys.exit(f"failed: {' '.join(cmd)}")
    return r.stdout if capture else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llvm-suffix", default="-19", help="suffix of llvm-profdata and llvm-cov (default -19)")
    ap.add_argument("--out", default="/tmp/candle-attention-cov", help="build and profile folder")
    a = ap.parse_args()
    profdata, cov = f"llvm-profdata{a.llvm_suffix}", f"llvm-cov{a.llvm_suffix}"
    for tool in (profdata, cov):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (Debian: apt install llvm{a.llvm_suffix})")

    prof = os.path.join(a.out, "prof")
    shutil.rmtree(prof, ignore_errors=True)
    os.makedirs(prof)
    env = dict(os.environ)
    env.update(
        CARGO_TARGET_DIR=os.path.join(a.out, "target"),
        RUSTFLAGS="-C instrument-coverage",
        LLVM_PROFILE_FILE=os.path.join(prof, "%p-%m.profraw"),
    )
    run(["cargo", "test", "--release"], env=env)
    listing = run(["cargo", "test", "--release", "--no-run", "--message-format=json"], env=env, capture=True)
    objects = sorted(
        {m["executable"] for m in map(json.loads, listing.splitlines()) if m.get("profile", {}).get("test") and m.get("executable")}
    )
    merged = os.path.join(a.out, "all.profdata")
    run([profdata, "merge", "-sparse", *glob.glob(os.path.join(prof, "*.profraw")), "-o", merged])
    args = [cov, "export", "-format=text", f"-instr-profile={merged}", "-skip-functions", objects[0]]
    for o in objects[1:]:
        args += ["-object", o]
    data = json.loads(run(args, capture=True))

    # Largest count of any region starting on each line of each file under src/.
    counts = {}
    src = os.path.join(ROOT, "src") + os.sep
    for f in data["data"][0]["files"]:
        if not f["filename"].startswith(src):
            continue
        lines = counts.setdefault(os.path.relpath(f["filename"], ROOT), {})
        for line, _col, count, has_count, *_ in f["segments"]:
            if has_count:
                lines[line] = max(lines.get(line, 0), count)

    sites, unreached = 0, []
    for path in sorted(glob.glob(os.path.join(ROOT, "src", "**", "*.rs"), recursive=True)):
        rel = os.path.relpath(path, ROOT)
        text = open(path, encoding="utf-8").read().split("\n")
        stop = next((i for i, l in enumerate(text) if "#[cfg(test)]" in l), len(text))
        lines = counts.get(rel, {})
        for i, l in enumerate(text[:stop]):
            if not SITE.search(l):
                continue
            sites += 1
            hit = next((lines[n] for n in range(i + 1, i + 6) if n in lines), None)
            if not hit:
                unreached.append(f"{rel}:{i + 1}  {l.strip()[:100]}")
    print(f"{sites} error sites; {len(unreached)} never reached by `cargo test --release`:")
    for u in unreached:
        print("  " + u)


if __name__ == "__main__":
    main()
