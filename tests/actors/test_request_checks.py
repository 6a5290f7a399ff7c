"""``length_hint``, ``speculate`` and ``temperature`` are checked once per boundary: where a
request enters (the ZeroMQ gateway's ``generate``, the command line's ``generate``, the HTTP
API: its rows are in ``gateway/test_http_errors.py``'s ``BAD_REQUESTS``) and where a scheduler
body crosses a process (``GenerateBody.from_wire``). A bad value at each entry is refused there,
naming its field; inside the process the scheduler trusts the checked object
(``scheduler/test_scheduler_core.py`` submits typed bodies without checks), so a gateway that
let a bad value through would fail these tests, not be caught later.
"""

from __future__ import annotations

from typing import Any

import pytest

from treeserve import cli
from treeserve.actors.gateway.actor import GatewayConfig
from treeserve.actors.gateway.request import InvalidRequest
from treeserve.actors.messages.gateway import GenerateBody
from treeserve.cli_common import UserError
from treeserve.cli_generate import cmd_generate
from treeserve.client import Client, InvalidRequestError
from treeserve_testing.gateway_fakes import fake_gateway

pytestmark = [pytest.mark.timeout(120)]

BAD = [("length_hint", 0), ("speculate", "forest"), ("temperature", -1.0)]


@pytest.mark.parametrize(("field", "value"), BAD)
async def test_the_zeromq_gateway_refuses_a_bad_value_where_it_enters(field: str, value: Any) -> None:
    async with fake_gateway(GatewayConfig(bind="tcp://127.0.0.1:0", context_length=64)) as (gw, fake):
        async with Client(gw.endpoint, timeout=20) as client:
            with pytest.raises(InvalidRequestError, match=field):
                await client.generate("x", max_tokens=2, **{field: value})
            assert (await client.generate("ok", max_tokens=3)).text == "oko"
    assert list(fake.bodies) == [next(iter(fake.bodies))]  # only the good request reached the scheduler


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_scheduler_body_from_another_process_is_refused_naming_the_field(field: str, value: Any) -> None:
    body: dict[str, Any] = {"prompt_ids": [1, 2], "params": {"max_new_tokens": 4}}
    if field == "temperature":
        body["params"]["temperature"] = value
    else:
        body[field] = value
    with pytest.raises(InvalidRequest) as refused:
        GenerateBody.received(body, vocab_size=10, context_length=32)
    assert refused.value.param == ("params" if field == "temperature" else field) and field in str(refused.value)


@pytest.mark.parametrize(("flags", "says"), [
    (["--temperature", "-1"], "'temperature' must be >= 0"),
    (["--speculate", "forest"], "invalid choice: 'forest'"),
])
def test_the_command_lines_generate_refuses_a_bad_value_before_any_process_starts(
        flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    try:
        cmd_generate(parser.parse_args(["generate", "Hi", "--max-tokens", "2", *flags]))
    except UserError as refused:
        assert says in str(refused)
    except SystemExit as refused:  # argparse's own refusal of a value outside the choices
        assert refused.code == 2 and says in capsys.readouterr().err
    else:
        pytest.fail(f"generate accepted {flags}")
