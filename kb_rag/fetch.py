"""Fetch: HTTP client: DOI / arXiv / URL -> PDF, landing pages, Unpaywall, downloads.

May import: config, storage.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .config import KBError, __version__, _opt_str, _short_error
from .storage import _write_atomically

# Standard library only. Every request: http(s) only (redirects too), at most FETCH_MAX_REDIRECTS redirects,
# a per-request timeout (KB_FETCH_TIMEOUT), an overall deadline (KB_FETCH_DEADLINE, default 4 x the timeout),
# a byte cap (KB_FETCH_MAX_MB), and the body must start with %PDF- to be kept.

FETCH_USER_AGENT = f"kb-rag/{__version__} (local literature knowledge base; paper fetch)"
FETCH_MAX_REDIRECTS = 10
FETCH_CHUNK_BYTES = 64 * 1024
FETCH_PAGE_MAX_BYTES = 4 * 1024 * 1024  # a landing page or Unpaywall record is read up to this, not the PDF cap
_FETCH_DOI = re.compile(r"^10\.\d{4,9}/\S+$")
_FETCH_ARXIV_NEW = re.compile(r"^(\d{4}\.\d{4,5})(v\d+)?$")
_FETCH_ARXIV_OLD = re.compile(r"^([a-z][a-z-]*(?:\.[a-z]{2})?/\d{7})(v\d+)?$", re.IGNORECASE)
_FETCH_DOI_PREFIXES = ("https://doi.org/", "http://doi.org/", "https://dx.doi.org/", "http://dx.doi.org/", "doi:")
_FETCH_ARXIV_URL = re.compile(r"^https?://(?:www\.|export\.)?arxiv\.org/(?:abs|pdf)/(.+?)(?:\.pdf)?/?$", re.IGNORECASE)


@dataclass
class FetchSettings:
    arxiv: str
    resolver: str
    unpaywall: str
    email: str | None
    max_bytes: int
    timeout: float
    deadline: float  # time.monotonic() past which no request starts or continues
    # the settings that set the limits above, named in the messages of the failures they cause
    timeout_name: str = "KB_FETCH_TIMEOUT"
    deadline_name: str = "KB_FETCH_DEADLINE"
    size_name: str = "KB_FETCH_MAX_MB"


def fetch_settings_number(name: str, default: float) -> float:
    """A positive number of seconds or megabytes from the environment; the default when unset or invalid."""
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def fetch_settings() -> FetchSettings:
    number = fetch_settings_number
    timeout = number("KB_FETCH_TIMEOUT", 30.0)
    return FetchSettings(
        arxiv=(os.environ.get("KB_ARXIV_URL") or "https://arxiv.org").rstrip("/"),
        resolver=(os.environ.get("KB_DOI_RESOLVER") or "https://doi.org").rstrip("/"),
        unpaywall=(os.environ.get("KB_UNPAYWALL_URL") or "https://api.unpaywall.org/v2").rstrip("/"),
        email=os.environ.get("KB_UNPAYWALL_EMAIL") or None,
        max_bytes=int(number("KB_FETCH_MAX_MB", 100.0) * 1024 * 1024),
        timeout=timeout,
        deadline=time.monotonic() + number("KB_FETCH_DEADLINE", timeout * 4),
    )


def parse_identifier(text: str) -> tuple[str, str]:
    """(kind, value): ("doi", "10.x/y") lower-cased, ("arxiv", "2301.05883" or "hep-th/9901001"), ("url", url)."""
    from urllib.parse import unquote

    value = (text or "").strip()
    lower = value.lower()
    for prefix in _FETCH_DOI_PREFIXES:
        if lower.startswith(prefix):
            doi = unquote(value[len(prefix) :].strip())
            if _FETCH_DOI.match(doi):
                return "doi", doi.lower()
            raise KBError("bad_request", f"not a DOI: {text!r} (expected 10.<registrant>/<suffix>)")
    arxiv_url = _FETCH_ARXIV_URL.match(value)
    if lower.startswith("arxiv:") or arxiv_url:
        candidate = arxiv_url.group(1) if arxiv_url else value[6:].strip()
        match = _FETCH_ARXIV_NEW.match(candidate) or _FETCH_ARXIV_OLD.match(candidate)
        if match:
            return "arxiv", match.group(0)
        if not arxiv_url:
            raise KBError(
                "bad_request", f"not an arXiv id: {text!r} (expected e.g. arXiv:2301.05883 or hep-th/9901001)"
            )
    if _FETCH_DOI.match(value):
        return "doi", value.lower()
    match = _FETCH_ARXIV_NEW.match(value) or _FETCH_ARXIV_OLD.match(value)
    if match:
        return "arxiv", match.group(0)
    if lower.startswith(("http://", "https://")) and len(value) > 8 and not any(c.isspace() for c in value):
        return "url", value
    raise KBError(
        "bad_request",
        f"identifier {text!r} is not a DOI (10.x/y, doi:..., https://doi.org/...), "
        "an arXiv id (arXiv:2301.05883, hep-th/9901001) or an http(s) URL",
    )


def _fetch_redirect_handler():
    import urllib.request
    from urllib.parse import urljoin, urlsplit

    class Redirects(urllib.request.HTTPRedirectHandler):
        """Follows http(s) redirects only, refuses loops and more than FETCH_MAX_REDIRECTS hops."""

        max_redirections = FETCH_MAX_REDIRECTS

        def http_error_302(self, req, fp, code, msg, headers):
            location = headers.get("location") or headers.get("uri")
            if location:
                target = urljoin(req.full_url, location)
                if urlsplit(target).scheme.lower() not in ("http", "https"):
                    fp.close()
                    raise KBError(
                        "fetch_failed",
                        f"{req.full_url} redirects to {target}: refused, only http(s) redirects are followed",
                    )
                visited = getattr(req, "redirect_dict", {})
                if target == req.full_url or target in visited:
                    fp.close()
                    raise KBError("fetch_failed", f"{req.full_url} redirects to {target}: redirect loop")
                if sum(visited.values()) >= FETCH_MAX_REDIRECTS:
                    fp.close()
                    raise KBError("fetch_failed", f"{req.full_url}: more than {FETCH_MAX_REDIRECTS} redirects")
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    return Redirects()


@dataclass
class FetchResponse:
    url: str  # after redirects
    status: int
    content_type: str
    body: bytes

    @property
    def is_pdf(self) -> bool:
        return self.body[:1024].lstrip().startswith(b"%PDF-")

    def describe(self) -> str:
        """What came back, for an error: content type and, for an HTML page, its title."""
        kind = self.content_type or "no content type"
        text = self.body[:200_000].decode("utf-8", "replace")
        title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        if title:
            name = " ".join(html.unescape(title.group(1)).split())[:120]
            return f"an HTML page ({kind}) titled {name!r} from {self.url}"
        if "html" in kind.lower() or re.match(r"\s*<(!doctype|html)", text, re.IGNORECASE):
            return f"an HTML page ({kind}) from {self.url}"
        return f"{kind} ({len(self.body)} bytes, not a PDF) from {self.url}"


def _fetch_failed(url: str, what: str) -> KBError:
    return KBError("fetch_failed", f"fetching {url} failed: {what}")


def http_get(url: str, settings: FetchSettings, accept: str, max_bytes: int | None = None) -> FetchResponse:
    """One GET with the limits above. HTTP errors come back as a response (status >= 400) so that the
    caller can name the page; network failures, timeouts and the deadline raise fetch_failed, the cap too_large."""
    import socket
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    cap = settings.max_bytes if max_bytes is None else min(max_bytes, settings.max_bytes)
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise KBError("fetch_failed", f"refusing {url}: only http(s) URLs are fetched")
    remaining = settings.deadline - time.monotonic()
    if remaining <= 0:
        raise _fetch_failed(url, f"the deadline passed ({settings.deadline_name})")
    opener = urllib.request.build_opener(_fetch_redirect_handler())
    request = urllib.request.Request(url, headers={"User-Agent": FETCH_USER_AGENT, "Accept": accept})
    try:
        try:
            response = opener.open(request, timeout=min(settings.timeout, remaining))
        except urllib.error.HTTPError as exc:
            response = exc
        with response:
            status = response.status if response.status is not None else response.getcode()
            final_url = response.geturl() or url
            content_type = response.headers.get("Content-Type", "") if response.headers else ""
            length = response.headers.get("Content-Length") if response.headers else None
            if status < 400 and length and length.strip().isdigit() and int(length) > cap:
                raise KBError(
                    "too_large",
                    f"{final_url} announces {int(length)} bytes, over the limit of {cap} bytes ({settings.size_name})",
                )
            parts, total = [], 0
            # read1 returns what one receive brings, so a server that drips a byte at a time meets the deadline
            # check after every byte instead of filling a whole chunk first
            read_some = getattr(response, "read1", None) or response.read
            while True:
                if time.monotonic() > settings.deadline:
                    raise _fetch_failed(
                        final_url, f"the deadline passed while reading the body ({settings.deadline_name})"
                    )
                chunk = read_some(FETCH_CHUNK_BYTES)
                if not chunk:
                    break
                total += len(chunk)
                if total > cap:
                    if status >= 400 or max_bytes is not None:  # an error page or landing page: enough of it
                        break
                    raise KBError(
                        "too_large", f"{final_url} sent more than {cap} bytes, the limit ({settings.size_name})"
                    )
                parts.append(chunk)
    except KBError:
        raise
    except TimeoutError:
        raise _fetch_failed(url, f"timed out after {settings.timeout:g} s ({settings.timeout_name})") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise _fetch_failed(url, f"timed out after {settings.timeout:g} s ({settings.timeout_name})") from None
        raise _fetch_failed(url, f"cannot connect ({reason}); the network may be offline or blocked") from None
    except (OSError, ValueError, http_client_errors()) as exc:
        raise _fetch_failed(url, f"{type(exc).__name__}: {exc}") from None
    return FetchResponse(final_url, int(status or 0), content_type, b"".join(parts))


def http_client_errors():
    import http.client

    return http.client.HTTPException


def _http_failure(response: FetchResponse) -> str:
    import http.client

    reason = http.client.responses.get(response.status, "")
    return f"HTTP {response.status}{' ' + reason if reason else ''} from {response.url}"


def _meta_content(page: str, name: str) -> str | None:
    """The content of the first <meta name=NAME content=...> (attributes in any order)."""
    for tag in re.finditer(r"<meta\b[^>]*>", page, re.IGNORECASE):
        attrs = {
            m.group(1).lower(): html.unescape(m.group(3) if m.group(3) is not None else m.group(4) or "")
            for m in re.finditer(r"([a-zA-Z_:-]+)\s*=\s*(?:(['\"])(.*?)\2|([^\s>]+))", tag.group(0))
        }
        if (attrs.get("name") or attrs.get("property") or "").lower() == name and attrs.get("content", "").strip():
            return attrs["content"].strip()
    return None


def _pdf_from_page(page: FetchResponse, settings: FetchSettings, accept: str) -> tuple[FetchResponse | None, str]:
    """Follow a landing page's citation_pdf_url; (the PDF or None, what happened)."""
    from urllib.parse import urljoin

    link = _meta_content(page.body.decode("utf-8", "replace"), "citation_pdf_url")
    if not link:
        return None, f"{page.describe()} without a citation_pdf_url"
    pdf = http_get(urljoin(page.url, link), settings, accept)
    if pdf.status >= 400:
        return None, f"{page.describe()}, whose citation_pdf_url gave {_http_failure(pdf)}"
    if not pdf.is_pdf:
        return None, f"{page.describe()}, whose citation_pdf_url gave {pdf.describe()}"
    return pdf, ""


def _unpaywall_pdf(doi: str, settings: FetchSettings, accept: str) -> tuple[FetchResponse | None, str]:
    from urllib.parse import quote

    if not settings.email:
        return None, "Unpaywall not asked (set KB_UNPAYWALL_EMAIL to look for an open-access copy)"
    url = f"{settings.unpaywall}/{quote(doi, safe='/')}?email={quote(settings.email)}"
    record = http_get(url, settings, "application/json", FETCH_PAGE_MAX_BYTES)
    if record.status >= 400:  # named without the query, which holds the e-mail address
        return None, f"Unpaywall gave {_http_failure(record).split('?')[0]}"
    try:
        data = json.loads(record.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, f"Unpaywall gave {record.describe()}"
    locations = [data.get("best_oa_location")] + list(data.get("oa_locations") or []) if isinstance(data, dict) else []
    links = []
    for location in locations:
        if (
            isinstance(location, dict)
            and isinstance(location.get("url_for_pdf"), str)
            and location["url_for_pdf"] not in links
        ):
            links.append(location["url_for_pdf"])
    if not links:
        return None, "Unpaywall knows no open-access PDF"
    notes = []
    for link in links[:3]:
        pdf = http_get(link, settings, accept)
        if pdf.status < 400 and pdf.is_pdf:
            return pdf, ""
        notes.append(_http_failure(pdf) if pdf.status >= 400 else pdf.describe())
    return None, "Unpaywall's open-access links gave " + "; ".join(notes)


def resolve_pdf(kind: str, value: str, settings: FetchSettings) -> tuple[FetchResponse, str]:
    """(the PDF response, source: arxiv | publisher | unpaywall | direct); not_pdf or fetch_failed otherwise."""
    from urllib.parse import quote

    accept = "application/pdf,text/html;q=0.8,*/*;q=0.5"
    if kind == "arxiv":
        first = http_get(f"{settings.arxiv}/pdf/{value}", settings, accept)
        source = "arxiv"
    elif kind == "url":
        first = http_get(value, settings, accept)
        source = "direct"
    else:
        first = http_get(f"{settings.resolver}/{quote(value, safe='/:;()._-<>')}", settings, accept)
        source = "publisher"
    if first.status < 400 and first.is_pdf:
        return first, source
    notes: list[str] = []
    html_seen = first.status < 400 or "html" in first.content_type.lower()
    if first.status >= 400:
        notes.append(_http_failure(first))
    elif kind != "arxiv":
        pdf, note = _pdf_from_page(first, settings, accept)
        if pdf is not None:
            return pdf, "publisher" if kind == "doi" else "direct"
        notes.append(note)
    else:
        notes.append(first.describe())
    if kind == "doi":
        pdf, note = _unpaywall_pdf(value, settings, accept)
        if pdf is not None:
            return pdf, "unpaywall"
        notes.append(note)
    message = f"no PDF for {value}: " + "; ".join(notes)
    if first.status < 400 and html_seen:
        raise KBError("not_pdf", message)
    raise KBError("fetch_failed", message)


def fetch_file_name(kind: str, value: str, final_url: str, body: bytes) -> str:
    """A safe file name: from the DOI or arXiv id, else from the URL's last path segment."""
    from urllib.parse import unquote, urlsplit

    if kind == "doi":
        stem = value
    elif kind == "arxiv":
        stem = "arXiv_" + value
    else:
        stem = Path(unquote(urlsplit(final_url).path)).name
        stem = stem[:-4] if stem.lower().endswith(".pdf") else stem
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._-")[:150]
    if not stem:
        stem = "paper_" + hashlib.sha256(body).hexdigest()[:12]
    return stem + ".pdf"


def _fetch_dest(payload: dict, root: Path) -> Path:
    raw = _opt_str(payload, "dest")
    dest = Path(raw).expanduser().absolute() if raw and raw.strip() else root / "papers"
    if dest.exists() and not dest.is_dir():
        raise KBError("bad_request", f"dest {dest} exists and is not a directory")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KBError("bad_request", f"dest {dest} cannot be created as a directory: {_short_error(exc)}") from None
    return dest


def save_fetched(dest: Path, name: str, body: bytes) -> Path:
    """Write body as dest/name (atomically; an identical existing file is left untouched)."""
    target = dest / name
    if target.parent.resolve() != dest.resolve() or target.name != name:
        raise KBError("bad_request", f"refusing to write {name!r} outside {dest}")
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise KBError("bad_request", f"{target} exists and is not a regular file")
    if target.is_file():
        try:
            if target.stat().st_size == len(body) and target.read_bytes() == body:
                return target
        except OSError:
            pass
    try:
        _write_atomically(target, body)
    except OSError as exc:
        raise KBError("fetch_failed", f"cannot save {target}: {_short_error(exc)}") from None
    return target


def fetch_identifier(payload: dict) -> tuple[str, str, str]:
    """(identifier as sent, kind, value); bad_request when it is missing or not recognised."""
    identifier = _opt_str(payload, "identifier")
    if not identifier or not identifier.strip():
        raise KBError("bad_request", "fetch needs identifier: a DOI, an arXiv id or an http(s) URL")
    return (identifier, *parse_identifier(identifier))
