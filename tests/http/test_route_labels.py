"""The route label of metrics, log lines and spans: every declared route by its path (the ops
routes included: FastAPI keeps an included router's routes inside it), any other path `other`."""

from __future__ import annotations

from semif_serve.app import create_app
from tests.http.test_operations import metric
from tests.support import in_process_client, request_log_lines


def test_the_ops_routes_are_labelled_by_their_paths_and_a_scrape_is_not_logged(service):
    client = in_process_client(create_app(service))
    with request_log_lines() as lines:
        for path in ("/health", "/livez", "/metrics", "/no-such-path"):
            client.get(path)
    text = client.get("/metrics").text
    for path in ("/health", "/livez", "/metrics"):
        assert metric(text, "semif_requests_total", route=path, status="200") >= 1, path
    assert metric(text, "semif_requests_total", route="other", status="404") == 1
    assert [line["route"] for line in lines] == ["/livez", "other"]
