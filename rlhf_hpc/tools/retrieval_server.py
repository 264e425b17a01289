"""A retrieval service with Search-R1's API over a BM25 index (rlhf_hpc/tools/bm25.py), for the
search tool's ``retrieval_service_url`` (verl's search tool config names ``http://127.0.0.1:8000/retrieve``):

    python -m rlhf_hpc.tools.retrieval_server --corpus corpus.jsonl [--host 127.0.0.1] [--port 8000]

``POST /retrieve`` with ``{"queries": [...], "topk": k, "return_scores": true}`` answers
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...] per query]}`` (without scores:
the documents alone), as Search-R1's ``retrieval_server.py``. One index serves every rank of a node
(or of the job) instead of one per rank."""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_hpc.tools.bm25 import Bm25Index, read_corpus

__all__ = ["main", "serve"]


def serve(index: Bm25Index, host: str, port: int) -> ThreadingHTTPServer:
    """The server, bound (port 0: a free one, ``server.server_address``); ``serve_forever()`` runs it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/retrieve":
                return self._reply(404, {"error": f"no {self.path}; POST /retrieve"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries, topk = body["queries"], int(body.get("topk", 3))
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise ValueError("queries: expected a list of strings")
            except (ValueError, KeyError, TypeError) as e:
                return self._reply(400, {"error": f"{type(e).__name__}: {e}"})
            results = index.retrieve(queries, topk)
            if not body.get("return_scores", True):
                results = [[r["document"] for r in per_query] for per_query in results]
            self._reply(200, {"result": results})

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # (quiet: one line a request would flood a job's log)
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.tools.retrieval_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help='JSONL passages: {"id", "contents": "title\\ntext"}')
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    try:
        index = Bm25Index(read_corpus(args.corpus))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = serve(index, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {len(index.docs)} passages at http://{host}:{port}/retrieve", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
