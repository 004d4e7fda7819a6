"""What the benchmarks (`bench/`) and the acceptance checks (`acceptance/`) share: a real
semif-serve on a loopback port (`server`), its HTTP client (`client`), tables and result files
(`report`), statistics (`stats`), synthetic workloads fitted to the service's tokenizer
(`workloads`), the measurements that both a bench script and `gpu_run` run (`batching`,
`adapters`) and model geometries (`geometry`).

One way only: `harness` may import `semif_serve`, and `bench` and `acceptance` may import
`harness`, never the other way; `bench` and `acceptance` know nothing of each other
(import-linter's contracts in pyproject.toml).
"""
