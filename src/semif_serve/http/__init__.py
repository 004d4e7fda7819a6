"""HTTP around the doors: errors, authentication, admission, body decoding, the server,
request ids, logs and metrics."""
