"""`kvcache why REQUEST_ID`: why a recent request of a running `kvcache serve` did or did not match an
earlier prompt (its usage.kvcache_prefix), with the 12 decoded tokens either side of where it parted,
read from the server's GET /v1/why/{id}."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

MAX_ANSWER_BYTES = 1 << 20


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="the response's id (chatcmpl-… or cmpl-…)")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the server's origin (default http://127.0.0.1:8000)")
    parser.add_argument("--api-key-file", default=None,
                        help="a file holding the server's admin key (when it was started with keys)")
    parser.add_argument("--json", action="store_true", help="print the server's answer as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        answer = _fetch(args)
    except (OSError, ValueError) as error:
        print(f"kvcache why: error: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(describe(answer))
    return 0


def _fetch(args: argparse.Namespace) -> dict:
    """The server's answer for args.request_id; OSError/ValueError saying what went wrong."""
    headers = {}
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as file:
            headers["Authorization"] = f"Bearer {file.read(4096).strip()}"
    url = f"{args.url.rstrip('/')}/v1/why/{urllib.parse.quote(args.request_id, safe='')}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return json.loads(response.read(MAX_ANSWER_BYTES))
    except urllib.error.HTTPError as error:
        body = error.read(MAX_ANSWER_BYTES).decode("utf-8", "replace")
        try:
            said = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            said = body[:200]
        raise OSError(f"{url} answered {error.code}: {said}") from None


def describe(answer: dict) -> str:
    """The explanation in a few lines: cause, segment, where, and the tokens around it."""
    at = answer.get("first_divergent_token")
    where = "no divergence" if at is None else f"diverged at token {at}"
    lines = [f"{answer['id']}: {answer['cause']} in {answer['segment']} ({where}; "
             f"{answer['matched_tokens']} tokens matched an earlier prompt"
             f"{'; evicted from ' + answer['tier'] if answer.get('tier') else ''})"]
    if "before" in answer:
        lines.append(f"  before: {answer['before']!r}")
        lines.append(f"  after:  {answer['after']!r}")
    return "\n".join(lines)
