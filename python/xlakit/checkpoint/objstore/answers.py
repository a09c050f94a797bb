"""What an object store's failure means: worth retrying (transient), or a request to slow down.

Read through the chain of causes, since the client libraries wrap what the
server answered: s3fs turns botocore's errors into OSErrors (a 503 into EBUSY),
gcsfs raises its own HttpError, aiohttp its connection errors.
"""

from __future__ import annotations

from collections.abc import Iterator

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """`e` and its causes, each once."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_transient(e: BaseException) -> bool:
    """A failure worth retrying: the connection, or a status the store says to retry."""
    return any(_transient_one(c) for c in _chain(e))


def throttled(e: BaseException | None) -> bool:
    """Whether `e`, or a cause of it, is the store asking for fewer requests (429, S3's SlowDown)."""
    return any(_throttled_one(c) for c in _chain(e))


def _throttled_one(e: BaseException) -> bool:
    status = getattr(e, "code", None) or getattr(e, "status", None)
    response = getattr(e, "response", None)  # botocore's ClientError
    if isinstance(response, dict):
        status = status or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 429 or "SlowDown" in str(e) or "TooManyRequests" in str(e)


def _transient_one(e: BaseException) -> bool:
    import aiohttp

    if isinstance(e, (ConnectionError, aiohttp.ClientError)) and not isinstance(e, aiohttp.ClientResponseError):
        return True
    if type(e).__module__.startswith("botocore") and any(
            c.__name__ in ("ConnectionError", "HTTPClientError") for c in type(e).__mro__):
        return True  # EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, ...
    status = getattr(e, "code", None) or getattr(e, "status", None)
    if not isinstance(status, int):
        status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") \
            if isinstance(getattr(e, "response", None), dict) else None
    return isinstance(status, int) and status in _TRANSIENT_STATUS
