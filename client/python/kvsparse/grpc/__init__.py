"""kvsparse over gRPC: the clients of kvsparse-server's KvStore and Attention services
(``client``: ``Client``, both over one channel; ``kvstore``; ``attention``), the channel with TLS
and tokens (``channel``), and ``LocalServer``, a server process for tests and notebooks
(``local_server``). The package's top level re-exports the public names."""
