"""The gateway's gRPC side (`--grpc-port`): SMG's SGLang worker service and radixserve's own
text-level service, on the same validation, dispatch, deadlines, abort-on-cancel and admission
control as HTTP (services/gateway/dispatch.py)."""
