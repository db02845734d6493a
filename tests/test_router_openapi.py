"""router/openapi.py: the document is valid OpenAPI and documents exactly the routes the app serves."""

from __future__ import annotations

import schemathesis
from starlette.routing import Route

from router.app import create_app
from router.openapi import SPEC
from router.settings import Settings


def test_openapi_document_is_valid_and_complete() -> None:
    schemathesis.openapi.from_dict(SPEC).validate()
    app = create_app(Settings(insecure_dev=True))  # the live app's routes, not the lists it is built from
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    documented = {
        (path, method) for path, item in SPEC["paths"].items() for method in item if method != "parameters"
    }
    assert served == documented
    for path, method in documented:
        responses = SPEC["paths"][path][method]["responses"]
        assert any(code.startswith("2") for code in responses), (path, method)
