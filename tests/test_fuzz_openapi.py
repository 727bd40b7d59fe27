"""Schemathesis over ortspec serve's own OpenAPI description (GET /openapi.json, serve/openapi.py):
cases drawn from the schema, valid and not, against a live server on the tiny model; each
answer must conform to the description (status, media type, body schema), schema-violating
bodies must get 4xx, and nothing a 5xx. Left out: schemathesis' positive_data_acceptance (every
schema-valid body gets a 2xx), since a prompt's length in tokens and its ids' range depend on
the model and no schema says them: those get 400 by design."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

import ortspec
from ortspec.serve.server import Server
from tools.serve_load import get


@pytest.fixture(scope="module")
def server(tokenized_model):
    with ortspec.Session(tokenized_model, num_speculative_tokens=2) as session, \
            Server(session, port=0, max_batch_size=2) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_dict(json.loads(get(server.url, "/openapi.json")[1]))


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_every_answer_conforms_to_the_description(case, server):
    case.call_and_validate(base_url=server.url, excluded_checks=[schemathesis.checks.positive_data_acceptance])
