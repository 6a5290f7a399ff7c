"""The front ends: the ZeroMQ gateway actor (``actor``, its settings in ``config``, client
liveness in ``peers``), the OpenAI HTTP API (``http_api``: the aiohttp server; ``http_config``;
``openai_api``: the API's request and error shapes; ``http_generate``: a generation's answer and
event stream), and what both share: a request parsed and checked once where it enters
(``request``) and the relay of a generation from the scheduler (``stream``)."""
