// kiln::dist::Store: the key-value store through which the ranks of a job find each other, as
// c10d's Store. TCPStore is the one used across processes and nodes: rank 0 runs the server (a
// thread in its process) on MASTER_ADDR:MASTER_PORT and every rank, rank 0 included, is a client.
//
//   kiln::dist::TCPStoreOptions o;
//   o.port = 29500;
//   o.is_server = rank == 0;
//   o.timeout = std::chrono::seconds(30);
//   kiln::dist::TCPStore store("10.0.0.1", o);
//   store.set("addr/3", bytes);                 // any bytes
//   auto v = store.get("addr/0");               // waits until the key exists (or times out)
//   int64_t n = store.add("joined", 1);         // atomic counter; returns the new value
//   store.wait({"ready"});                      // waits until all the keys exist
//
// PrefixStore puts every key of a store under "prefix/", so that several groups share one.
//
// Pitfalls:
// - Every blocking call (get, wait, connecting) ends after the store's timeout with a kiln::Error
//   that names the keys and the address; nothing waits forever.
// - A client keeps retrying the connection until the timeout: ranks may start before rank 0.
// - port 0 on the server binds a free port: read it back with port() (tests use this).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace kiln::dist {

using Milliseconds = std::chrono::milliseconds;
inline constexpr Milliseconds kDefaultStoreTimeout{300000};  // c10d's default: 5 minutes

class Store {
 public:
  explicit Store(Milliseconds timeout = kDefaultStoreTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;

  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  void set(const std::string& key, const std::string& value) {
    set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  // The value of `key`, waiting until it is set (up to the timeout).
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
  std::string get_string(const std::string& key) {
    auto v = get(key);
    return std::string(v.begin(), v.end());
  }
  // Adds `delta` to the integer stored at `key` (0 when absent) and returns the result.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether all `keys` exist now (does not wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until all `keys` exist: up to `timeout`, or the store's timeout when none is given.
  virtual void wait(const std::vector<std::string>& keys,
                    std::optional<Milliseconds> timeout = std::nullopt) = 0;
  // Removes `key`; false when it did not exist.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;

  Milliseconds timeout() const { return timeout_; }
  virtual void set_timeout(Milliseconds timeout) { timeout_ = timeout; }

 protected:
  Milliseconds timeout_;
};

struct TCPStoreOptions {
  uint16_t port = 29500;
  bool is_server = false;
  // Server only: when set, the constructor also waits until this many clients (the server's own
  // included) have connected, as c10d's wait_for_workers.
  std::optional<int> num_workers;
  Milliseconds timeout = kDefaultStoreTimeout;
};

namespace internal {
class TCPStoreServer;
}

class TCPStore final : public Store {
 public:
  // Connects to host:port (retrying until the timeout); with is_server, first starts the server
  // on that port (all interfaces) in a background thread of this process.
  TCPStore(std::string host, const TCPStoreOptions& options);
  ~TCPStore() override;
  TCPStore(const TCPStore&) = delete;
  TCPStore& operator=(const TCPStore&) = delete;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            std::optional<Milliseconds> timeout = std::nullopt) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;

  const std::string& host() const { return host_; }
  // The port the server listens on (the bound one when the options asked for port 0).
  uint16_t port() const { return port_; }

 private:
  // Sends one request and reads its reply, waiting at most `timeout` for the reply; on a
  // timeout the connection is re-opened (dropping the server's pending reply) and an error
  // describing `what` is thrown.
  std::vector<uint8_t> request(const std::vector<uint8_t>& message, Milliseconds timeout,
                               const std::string& what);
  void connect_socket();
  void close_socket();

  std::string host_;
  uint16_t port_;
  std::unique_ptr<internal::TCPStoreServer> server_;
  int fd_ = -1;
  std::mutex mu_;  // one request at a time on the connection
};

// Every key of `store` prefixed with "prefix/".
class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  using Store::set;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            std::optional<Milliseconds> timeout = std::nullopt) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  void set_timeout(Milliseconds timeout) override;
  const std::shared_ptr<Store>& underlying_store() const { return store_; }

 private:
  std::string key(const std::string& k) const { return prefix_ + "/" + k; }
  std::vector<std::string> keys(const std::vector<std::string>& ks) const;
  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace kiln::dist
