"""The tools people run (`sglang-hs ...`): capture a dataset through exporting servers, check
(verify, inspect) and convert what they wrote, serve on CPU, the demo."""
