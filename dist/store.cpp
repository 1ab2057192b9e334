// TCPStore: a small request/reply protocol over TCP. Every message is a 4-byte little-endian
// length followed by that many bytes; a request starts with its command byte. The server is one
// thread polling all connections; requests that wait (GET of a missing key, WAIT) are parked
// until the keys are set and answered then. A client whose wait times out closes its
// connection, which drops what it had parked.
#include "dist/store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "tensor/error.h"

namespace kiln::dist {
namespace {

enum class Cmd : uint8_t { kSet = 1, kGet, kAdd, kCheck, kWait, kDelete, kNumKeys };

using Clock = std::chrono::steady_clock;

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_i64(std::vector<uint8_t>& out, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(u >> (8 * i)));
}
void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  put_u32(out, static_cast<uint32_t>(n));
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
void put_string(std::vector<uint8_t>& out, const std::string& s) { put_bytes(out, s.data(), s.size()); }

// Reads fields of a message; any overrun is a protocol error.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  uint32_t u32() {
    need(4);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p_[pos_ + i]) << (8 * i);
    pos_ += 4;
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p_[pos_ + i]) << (8 * i);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  uint8_t u8() {
    need(1);
    return p_[pos_++];
  }
  std::vector<uint8_t> bytes() {
    const uint32_t n = u32();
    need(n);
    std::vector<uint8_t> v(p_ + pos_, p_ + pos_ + n);
    pos_ += n;
    return v;
  }
  std::string string() {
    auto v = bytes();
    return std::string(v.begin(), v.end());
  }

 private:
  void need(size_t k) const {
    KILN_CHECK(pos_ + k <= n_, "[TCPStore] malformed message (", n_, " bytes)");
  }
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

std::vector<uint8_t> framed(const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out;
  out.reserve(payload.size() + 4);
  put_u32(out, static_cast<uint32_t>(payload.size()));
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::string errno_str(int e) { return std::strerror(e); }

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  return s;
}

int64_t ms_left(Clock::time_point deadline) {
  return std::chrono::duration_cast<Milliseconds>(deadline - Clock::now()).count();
}

}  // namespace

namespace internal {

// The server: one thread, poll(2) over the listening socket, a wake-up pipe and the clients.
class TCPStoreServer {
 public:
  explicit TCPStoreServer(uint16_t port) {
    listen_fd_ = open_listener(port);
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    if (::pipe(wake_) != 0) {
      ::close(listen_fd_);
      KILN_FAIL("[TCPStore] pipe failed: ", errno_str(errno));
    }
    thread_ = std::thread([this] { loop(); });
  }
  ~TCPStoreServer() {
    const char c = 0;
    [[maybe_unused]] auto r = ::write(wake_[1], &c, 1);
    thread_.join();
    for (auto& [fd, conn] : conns_) ::close(fd);
    ::close(listen_fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }
  uint16_t port() const { return port_; }
  int num_clients() {
    std::lock_guard<std::mutex> lock(count_mu_);
    return num_accepted_;
  }

 private:
  struct Waiter {
    int fd;
    Cmd cmd;
    std::string key;  // for GET
    size_t missing;
  };
  struct Conn {
    std::vector<uint8_t> in;
    std::vector<uint8_t> out;
  };

  static int open_listener(uint16_t port) {
    // Dual-stack IPv6 first (accepts IPv4 too), IPv4 when the host has no IPv6.
    std::string error;
    for (int family : {AF_INET6, AF_INET}) {
      const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        error = errno_str(errno);
        continue;
      }
      int one = 1, zero = 0;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      int rc;
      if (family == AF_INET6) {
        ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(port);
        rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(port);
        rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      }
      if (rc == 0 && ::listen(fd, 1024) == 0) return fd;
      error = errno_str(errno);
      ::close(fd);
      if (errno == EADDRINUSE) break;
    }
    KILN_FAIL("[TCPStore] cannot listen on port ", port, ": ", error,
              " (is another job using MASTER_PORT ", port, "? choose a free port)");
  }

  void loop() {
    for (;;) {
      std::vector<pollfd> fds;
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& [fd, conn] : conns_) {
        fds.push_back({fd, static_cast<short>(POLLIN | (conn.out.empty() ? 0 : POLLOUT)), 0});
      }
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          set_nodelay(fd);
          conns_[fd];
          std::lock_guard<std::mutex> lock(count_mu_);
          ++num_accepted_;
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        const int fd = fds[i].fd;
        if (!conns_.contains(fd)) continue;
        bool alive = true;
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) alive = read_from(fd);
        if (alive && (fds[i].revents & POLLOUT)) alive = flush(fd);
        if (!alive) drop(fd);
      }
    }
  }

  bool read_from(int fd) {
    Conn& c = conns_[fd];
    uint8_t buf[65536];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.in.insert(c.in.end(), buf, buf + n);
        continue;
      }
      if (n == 0) return false;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      return false;
    }
    size_t pos = 0;
    while (c.in.size() - pos >= 4) {
      const uint32_t len = Reader(c.in.data() + pos, 4).u32();
      if (c.in.size() - pos - 4 < len) break;
      try {
        handle(fd, Reader(c.in.data() + pos + 4, len));
      } catch (const std::exception&) {
        return false;  // a malformed request: drop the client
      }
      pos += 4 + len;
    }
    Conn& c2 = conns_[fd];
    c2.in.erase(c2.in.begin(), c2.in.begin() + static_cast<std::ptrdiff_t>(pos));
    return flush(fd);
  }

  bool flush(int fd) {
    Conn& c = conns_[fd];
    while (!c.out.empty()) {
      const ssize_t n = ::send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(c.out.begin(), c.out.begin() + n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    return true;
  }

  void drop(int fd) {
    ::close(fd);
    conns_.erase(fd);
    for (auto& [key, ws] : waiters_) {
      std::erase_if(ws, [fd](const std::shared_ptr<Waiter>& w) { return w->fd == fd; });
    }
  }

  void reply(int fd, const std::vector<uint8_t>& payload) {
    auto it = conns_.find(fd);
    if (it == conns_.end()) return;
    auto f = framed(payload);
    it->second.out.insert(it->second.out.end(), f.begin(), f.end());
  }

  void answer_waiter(const Waiter& w) {
    std::vector<uint8_t> out;
    if (w.cmd == Cmd::kGet) {
      const auto& v = data_.at(w.key);
      put_bytes(out, v.data(), v.size());
    } else {
      out.push_back(1);
    }
    reply(w.fd, out);
    flush(w.fd);  // errors surface on the next poll
  }

  void key_set(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    auto ws = std::move(it->second);
    waiters_.erase(it);
    for (auto& w : ws) {
      if (--w->missing == 0) answer_waiter(*w);
    }
  }

  void park(int fd, Cmd cmd, const std::vector<std::string>& keys) {
    auto w = std::make_shared<Waiter>(Waiter{fd, cmd, cmd == Cmd::kGet ? keys[0] : "", 0});
    std::set<std::string> missing;
    for (const auto& k : keys) {
      if (!data_.contains(k)) missing.insert(k);
    }
    w->missing = missing.size();
    if (w->missing == 0) {
      answer_waiter(*w);
      return;
    }
    for (const auto& k : missing) waiters_[k].push_back(w);
  }

  void handle(int fd, Reader r) {
    const auto cmd = static_cast<Cmd>(r.u8());
    std::vector<uint8_t> out;
    switch (cmd) {
      case Cmd::kSet: {
        std::string key = r.string();
        data_[key] = r.bytes();
        reply(fd, {1});
        key_set(key);
        return;
      }
      case Cmd::kGet:
        park(fd, cmd, {r.string()});
        return;
      case Cmd::kWait: {
        std::vector<std::string> keys(r.u32());
        for (auto& k : keys) k = r.string();
        park(fd, cmd, keys);
        return;
      }
      case Cmd::kAdd: {
        std::string key = r.string();
        const int64_t delta = r.i64();
        int64_t v = 0;
        if (auto it = data_.find(key); it != data_.end()) {
          v = std::stoll(std::string(it->second.begin(), it->second.end()));
        }
        v += delta;
        const std::string s = std::to_string(v);
        data_[key] = std::vector<uint8_t>(s.begin(), s.end());
        put_i64(out, v);
        reply(fd, out);
        key_set(key);
        return;
      }
      case Cmd::kCheck: {
        const uint32_t n = r.u32();
        bool all = true;
        for (uint32_t i = 0; i < n; ++i) all = data_.contains(r.string()) && all;
        reply(fd, {static_cast<uint8_t>(all)});
        return;
      }
      case Cmd::kDelete:
        reply(fd, {static_cast<uint8_t>(data_.erase(r.string()) > 0)});
        return;
      case Cmd::kNumKeys:
        put_i64(out, static_cast<int64_t>(data_.size()));
        reply(fd, out);
        return;
    }
    KILN_FAIL("[TCPStore] unknown command");
  }

  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  uint16_t port_ = 0;
  std::thread thread_;
  std::map<int, Conn> conns_;
  std::unordered_map<std::string, std::vector<uint8_t>> data_;
  std::unordered_map<std::string, std::vector<std::shared_ptr<Waiter>>> waiters_;
  std::mutex count_mu_;
  int num_accepted_ = 0;
};

}  // namespace internal

TCPStore::TCPStore(std::string host, const TCPStoreOptions& options)
    : Store(options.timeout), host_(std::move(host)), port_(options.port) {
  KILN_CHECK(options.timeout.count() > 0, "[TCPStore] the timeout must be positive, got ",
             options.timeout.count(), " ms");
  if (options.is_server) {
    server_ = std::make_unique<internal::TCPStoreServer>(options.port);
    port_ = server_->port();
  }
  connect_socket();
  if (server_ && options.num_workers) {
    const auto deadline = Clock::now() + timeout_;
    while (server_->num_clients() < *options.num_workers) {
      KILN_CHECK(Clock::now() < deadline, "[TCPStore] only ", server_->num_clients(), " of ",
                 *options.num_workers, " workers connected to port ", port_, " within ",
                 timeout_.count(), " ms");
      std::this_thread::sleep_for(Milliseconds(5));
    }
  }
}

TCPStore::~TCPStore() {
  close_socket();
  server_.reset();
}

void TCPStore::close_socket() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void TCPStore::connect_socket() {
  const auto deadline = Clock::now() + timeout_;
  const std::string where = host_ + ":" + std::to_string(port_);
  std::string last_error = "no address";
  auto backoff = Milliseconds(10);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
    if (gai != 0) {
      last_error = std::string("cannot resolve the host: ") + ::gai_strerror(gai);
    } else {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          set_nodelay(fd);
          fd_ = fd;
          break;
        }
        last_error = errno_str(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
      if (fd_ >= 0) return;
    }
    KILN_CHECK(Clock::now() + backoff < deadline, "[TCPStore] could not connect to ", where,
               " within ", timeout_.count(), " ms: ", last_error,
               " (is rank 0 running, and are MASTER_ADDR and MASTER_PORT the ones it uses?)");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, Milliseconds(500));
  }
}

std::vector<uint8_t> TCPStore::request(const std::vector<uint8_t>& message, Milliseconds timeout,
                                       const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string where = host_ + ":" + std::to_string(port_);
  if (fd_ < 0) connect_socket();
  auto lost = [&](const std::string& why) {
    close_socket();
    KILN_FAIL("[TCPStore] lost the connection to the store at ", where, " while ", what, ": ",
              why, " (has rank 0, which serves the store, exited?)");
  };
  const auto out = framed(message);
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t n = ::send(fd_, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) lost(errno_str(errno));
    sent += static_cast<size_t>(n);
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<uint8_t> in;
  size_t want = 4;
  bool have_len = false;
  while (in.size() < want) {
    const int64_t left = ms_left(deadline);
    if (left <= 0) {
      close_socket();  // the server drops the parked request with the connection
      KILN_FAIL("[TCPStore] timed out after ", timeout.count(), " ms ", what, " (store at ",
                where, ")");
    }
    pollfd p{fd_, POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) continue;
    uint8_t buf[65536];
    const ssize_t n = ::recv(fd_, buf, std::min(sizeof(buf), want - in.size()), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) lost("the server closed the connection");
    if (n < 0) lost(errno_str(errno));
    in.insert(in.end(), buf, buf + n);
    if (!have_len && in.size() == 4) {
      want = 4 + Reader(in.data(), 4).u32();
      have_len = true;
    }
  }
  return std::vector<uint8_t>(in.begin() + 4, in.end());
}

void TCPStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kSet)};
  put_string(m, key);
  put_bytes(m, value.data(), value.size());
  request(m, timeout_, "setting key '" + key + "'");
}

std::vector<uint8_t> TCPStore::get(const std::string& key) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kGet)};
  put_string(m, key);
  auto r = request(m, timeout_, "waiting for key '" + key + "'");
  return Reader(r.data(), r.size()).bytes();
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kAdd)};
  put_string(m, key);
  put_i64(m, delta);
  auto r = request(m, timeout_, "adding to key '" + key + "'");
  return Reader(r.data(), r.size()).i64();
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kCheck)};
  put_u32(m, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_string(m, k);
  auto r = request(m, timeout_, "checking keys " + join_keys(keys));
  return Reader(r.data(), r.size()).u8() != 0;
}

void TCPStore::wait(const std::vector<std::string>& keys, std::optional<Milliseconds> timeout) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kWait)};
  put_u32(m, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_string(m, k);
  request(m, timeout.value_or(timeout_), "waiting for keys " + join_keys(keys));
}

bool TCPStore::delete_key(const std::string& key) {
  std::vector<uint8_t> m{static_cast<uint8_t>(Cmd::kDelete)};
  put_string(m, key);
  auto r = request(m, timeout_, "deleting key '" + key + "'");
  return Reader(r.data(), r.size()).u8() != 0;
}

int64_t TCPStore::num_keys() {
  auto r = request({static_cast<uint8_t>(Cmd::kNumKeys)}, timeout_, "counting keys");
  return Reader(r.data(), r.size()).i64();
}

// --- PrefixStore -----------------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(store ? store->timeout() : kDefaultStoreTimeout),
      prefix_(std::move(prefix)),
      store_(std::move(store)) {
  KILN_CHECK(store_ != nullptr, "[PrefixStore] the underlying store is null");
}
void PrefixStore::set(const std::string& k, const std::vector<uint8_t>& value) {
  store_->set(key(k), value);
}
std::vector<uint8_t> PrefixStore::get(const std::string& k) { return store_->get(key(k)); }
int64_t PrefixStore::add(const std::string& k, int64_t delta) { return store_->add(key(k), delta); }
bool PrefixStore::check(const std::vector<std::string>& ks) { return store_->check(keys(ks)); }
void PrefixStore::wait(const std::vector<std::string>& ks, std::optional<Milliseconds> timeout) {
  store_->wait(keys(ks), timeout);
}
bool PrefixStore::delete_key(const std::string& k) { return store_->delete_key(key(k)); }
int64_t PrefixStore::num_keys() { return store_->num_keys(); }
void PrefixStore::set_timeout(Milliseconds timeout) {
  Store::set_timeout(timeout);
  store_->set_timeout(timeout);
}
std::vector<std::string> PrefixStore::keys(const std::vector<std::string>& ks) const {
  std::vector<std::string> out;
  out.reserve(ks.size());
  for (const auto& k : ks) out.push_back(key(k));
  return out;
}

}  // namespace kiln::dist
