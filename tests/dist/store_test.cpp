// TCPStore and PrefixStore (dist/store.h): the commands, waiting across clients, timeouts that
// end in errors naming the keys, a refused connection naming the address, a busy port.
#include "dist/store.h"

#include <gtest/gtest.h>

#include <thread>

#include "tensor/error.h"

namespace kiln::dist {
namespace {

using std::chrono::milliseconds;

TCPStoreOptions server_options(milliseconds timeout = milliseconds(5000)) {
  TCPStoreOptions o;
  o.port = 0;  // a free port
  o.is_server = true;
  o.timeout = timeout;
  return o;
}

TCPStoreOptions client_options(uint16_t port, milliseconds timeout = milliseconds(5000)) {
  TCPStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TCPStoreTest, SetGetAddCheckDelete) {
  TCPStore server("127.0.0.1", server_options());
  ASSERT_NE(server.port(), 0);
  TCPStore client("localhost", client_options(server.port()));
  client.set("a", "hello");
  EXPECT_EQ(server.get_string("a"), "hello");
  std::vector<uint8_t> bytes{0, 1, 255, 0};
  server.set("bin", bytes);
  EXPECT_EQ(client.get("bin"), bytes);
  client.set("a", "");  // overwrite with an empty value
  EXPECT_EQ(server.get_string("a"), "");
  EXPECT_EQ(client.add("n", 5), 5);
  EXPECT_EQ(server.add("n", -2), 3);
  EXPECT_EQ(client.get_string("n"), "3");
  EXPECT_TRUE(client.check({"a", "n"}));
  EXPECT_FALSE(client.check({"a", "missing"}));
  EXPECT_EQ(client.num_keys(), 3);
  EXPECT_TRUE(client.delete_key("a"));
  EXPECT_FALSE(client.delete_key("a"));
  EXPECT_FALSE(server.check({"a"}));
}

TEST(TCPStoreTest, GetAndWaitBlockUntilSet) {
  TCPStore server("127.0.0.1", server_options());
  std::thread writer([port = server.port()] {
    TCPStore c("127.0.0.1", client_options(port));
    std::this_thread::sleep_for(milliseconds(100));
    c.set("k1", "v1");
    std::this_thread::sleep_for(milliseconds(50));
    c.set("k2", "v2");
  });
  TCPStore reader("127.0.0.1", client_options(server.port()));
  EXPECT_EQ(reader.get_string("k1"), "v1");
  reader.wait({"k1", "k2"});
  EXPECT_EQ(reader.get_string("k2"), "v2");
  writer.join();
}

TEST(TCPStoreTest, ConcurrentAddsAreAtomic) {
  TCPStore server("127.0.0.1", server_options());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([port = server.port()] {
      TCPStore c("127.0.0.1", client_options(port));
      for (int i = 0; i < 50; ++i) c.add("count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(server.add("count", 0), 200);
}

TEST(TCPStoreTest, TimeoutsNameTheKeysAndTheStoreStaysUsable) {
  TCPStore server("127.0.0.1", server_options(milliseconds(200)));
  std::string e = error_of([&] { server.get("never"); });
  EXPECT_NE(e.find("[TCPStore] timed out after 200 ms waiting for key 'never'"),
                    std::string::npos)
      << e;
  e = error_of([&] { server.wait({"x", "y"}, milliseconds(50)); });
  EXPECT_NE(e.find("timed out after 50 ms waiting for keys 'x', 'y'"), std::string::npos) << e;
  // The connection was re-opened: a late value does not answer the next request.
  server.set("x", "1");
  EXPECT_EQ(server.get_string("x"), "1");
  EXPECT_EQ(server.add("c", 1), 1);
}

TEST(TCPStoreTest, RefusedConnectionNamesTheAddress) {
  // A port nobody listens on: bind a server, take its port, close it.
  uint16_t port;
  { port = TCPStore("127.0.0.1", server_options()).port(); }
  const std::string e = error_of([&] { TCPStore("127.0.0.1", client_options(port, milliseconds(300))); });
  EXPECT_NE(e.find("[TCPStore] could not connect to 127.0.0.1:" + std::to_string(port) +
                   " within 300 ms"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("MASTER_PORT"), std::string::npos) << e;
}

TEST(TCPStoreTest, BusyPortIsAnError) {
  TCPStore first("127.0.0.1", server_options());
  const std::string e = error_of([&] {
    TCPStore("127.0.0.1", server_options());
    TCPStoreOptions o = server_options();
    o.port = first.port();
    TCPStore second("127.0.0.1", o);
  });
  EXPECT_NE(e.find("[TCPStore] cannot listen on port " + std::to_string(first.port())),
            std::string::npos)
      << e;
}

TEST(TCPStoreTest, ServerExitIsAClearError) {
  auto server = std::make_unique<TCPStore>("127.0.0.1", server_options());
  TCPStore client("127.0.0.1", client_options(server->port()));
  client.set("a", "1");
  server.reset();
  const std::string e = error_of([&] { client.get("b"); });
  EXPECT_NE(e.find("[TCPStore] lost the connection to the store"), std::string::npos) << e;
}

TEST(TCPStoreTest, WaitForWorkers) {
  TCPStoreOptions o = server_options(milliseconds(300));
  o.num_workers = 2;
  const std::string e = error_of([&] { TCPStore("127.0.0.1", o); });
  EXPECT_NE(e.find("only 1 of 2 workers connected"), std::string::npos) << e;
}

TEST(PrefixStoreTest, KeysArePrefixed) {
  auto server = std::make_shared<TCPStore>("127.0.0.1", server_options());
  PrefixStore a("group0", server), b("group1", server);
  a.set("k", "a");
  b.set("k", "b");
  EXPECT_EQ(a.get_string("k"), "a");
  EXPECT_EQ(b.get_string("k"), "b");
  EXPECT_EQ(server->get_string("group0/k"), "a");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_TRUE(b.check({"k"}));
  EXPECT_FALSE(b.check({"n"}));
}

}  // namespace
}  // namespace kiln::dist
