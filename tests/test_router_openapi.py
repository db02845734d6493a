"""router/openapi.py: the document is valid OpenAPI and documents exactly the routes the app serves."""

from __future__ import annotations

import schemathesis

from router import probes, routes
from router.openapi import SPEC


def test_openapi_document_is_valid_and_complete() -> None:
    schemathesis.openapi.from_dict(SPEC).validate()
    served = {
        (path, method.lower())
        for route in [*routes.ROUTES, *probes.ROUTES]
        for path, method in ((route.path, m) for m in route.methods or ())
        if method != "HEAD"
    }
    documented = {
        (path, method) for path, item in SPEC["paths"].items() for method in item if method != "parameters"
    }
    assert served == documented
    for path, method in documented:
        responses = SPEC["paths"][path][method]["responses"]
        assert any(code.startswith("2") for code in responses), (path, method)
