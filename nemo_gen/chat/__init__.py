"""Chat on vLLM's own pieces, shared by the library and the HTTP front.

A chat's prompt rendered through vLLM's template application (``render``) and a finished answer
split into the assistant's message by vLLM's tool-call and reasoning parsers (``answers``). Both
the fleet's recorded sessions (``nemo_gen.fleet.session``, a library caller's ``fleet.session()``)
and the server's chat routes (``nemo_gen.server.tools``, ``nemo_gen.server.gateway``) need them
and must agree to the byte — a session's next turn compares the agent's echo of the answer with
the message it was given. The fleet never imports the server, so they live here, below both:
no HTTP, no Ray; errors are ``nemo_gen.errors.RequestError`` naming the field, which the server
answers as a 400.
"""
