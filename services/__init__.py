"""radixserve's services, one package each."""
