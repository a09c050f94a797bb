"""Which client library xlakit's object storage uses: the measurement behind the choice.

For each local server (fake-gcs-server for gs://, moto for s3://) and each
library (fsspec with gcsfs/s3fs; obstore), in a fresh process per row:

* a streamed upload of `--mib` MiB written in 16 MiB pieces from one reused
  buffer (the library's own streaming writer), wall time and peak RSS over the
  process's RSS before the upload;
* conditional create: two create-only writes of one name, how many succeed;
* whether the library reached the server through the standard variable alone
  (`STORAGE_EMULATOR_HOST`, `AWS_ENDPOINT_URL`).

Usage: .venv/bin/python bench/objstore_clients.py [--mib 512] [--repeat 3]
Best of `--repeat` (the machine is shared); docs/object-storage.md holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import high_water_mark, rss as _rss  # noqa: E402

PIECE = 16 << 20


def _fsspec_fs(url: str):
    if url.startswith("gs://"):
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(token="anon")
    import s3fs

    return s3fs.S3FileSystem()


def one(lib: str, url: str, mib: int) -> dict:
    piece = memoryview(bytearray(os.urandom(1 << 20)) * (PIECE >> 20))
    total = mib << 20
    if lib == "fsspec":
        fs = _fsspec_fs(url)
        fs.ls(url)  # imports and the connection pool are not the upload's memory
    else:
        import obstore
        from obstore.store import from_url

        store = from_url(url, client_options={"allow_http": True})
        obstore.list(store).collect()
    base = _rss()
    row: dict = {"lib": lib, "scheme": url[:2]}
    t = time.perf_counter()
    if lib == "fsspec":
        with fs.open(f"{url}/big", "wb", block_size=PIECE) as f:
            for _ in range(total // PIECE):
                f.write(piece)
    else:
        with obstore.open_writer(store, "big", buffer_size=PIECE) as f:
            for _ in range(total // PIECE):
                f.write(piece)
    row["upload_s"] = time.perf_counter() - t
    row["peak_rss_mib"] = (high_water_mark() - base) / (1 << 20)
    wins = 0
    for i in range(2):
        try:
            if lib == "fsspec":
                _fsspec_fs(url).pipe_file(f"{url}/commit", b"%d" % i, mode="create")
            else:
                obstore.put(store, "commit", b"%d" % i, mode="create")
            wins += 1
        except Exception as e:  # noqa: BLE001 - the second one is expected to fail; which way is the finding
            row["second_create_error"] = f"{type(e).__name__}: {str(e)[:80]}"
    row["creates_won_of_2"] = wins
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--one", nargs=3, metavar=("LIB", "URL", "MIB"))
    args = ap.parse_args()
    if args.one:
        lib, url, mib = args.one
        print(json.dumps(one(lib, url, int(mib))))
        return
    from tests.support.objstore_servers import Server

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in ("gs", "s3"):
            server = Server(scheme, Path(tmp) / scheme)
            try:
                # obstore does not read STORAGE_EMULATOR_HOST: pointed at gs:// it asks the GCE metadata
                # server for a token (a request off this machine), so that row is not run.
                for lib in ("fsspec", "obstore") if scheme == "s3" else ("fsspec",):
                    best = None
                    for _ in range(args.repeat):
                        env = {**os.environ, **server.env()}
                        out = subprocess.run([sys.executable, __file__, "--one", lib, server.bucket(), str(args.mib)],
                                             capture_output=True, text=True, env=env, timeout=1800)
                        if out.returncode != 0:
                            raise SystemExit(out.stderr[-3000:])
                        row = json.loads(out.stdout.strip().splitlines()[-1])
                        best = row if best is None or row["upload_s"] < best["upload_s"] else best
                    rows.append(best)
            finally:
                server.stop()
    print(f"streamed upload of {args.mib} MiB in {PIECE >> 20} MiB pieces, best of {args.repeat}")
    print(f"{'server':<8} {'library':<8} {'MiB/s':>7} {'peak RSS MiB':>13} {'creates won':>12}")
    for r in rows:
        print(f"{r['scheme']:<8} {r['lib']:<8} {args.mib / r['upload_s']:7.0f} {r['peak_rss_mib']:13.0f} "
              f"{r['creates_won_of_2']:>9} of 2")
    print("obstore on gs://: not run, it does not honour STORAGE_EMULATOR_HOST (asks the GCE metadata server)")


if __name__ == "__main__":
    main()
