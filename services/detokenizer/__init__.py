"""The detokenizer service: incremental detokenization, stop strings, text deltas to gateways."""
