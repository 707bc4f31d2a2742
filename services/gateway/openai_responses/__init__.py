"""OpenAI's Responses API, POST /v1/responses, stateless: a request becomes the chat job its
messages make (protocol.py, convert.py), and its replies a Response object or the stream of
Responses events (render.py, api.py)."""
