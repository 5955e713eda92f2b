// Which ranks of a group share a host. A host is named by a string (the hostname by
// default; CGX_HOSTNAME overrides it so that tests can force the cross-host path).
#pragma once

#include <string>
#include <vector>

#include "common/kv_store.h"

namespace cgx::topology {

class HostMap {
 public:
  // host_names[r] = the host of group rank r.
  explicit HostMap(std::vector<std::string> host_names);

  // Every rank publishes its host name through the store and reads all others'.
  static HostMap exchange(KeyValueStore& store, int rank, int size, const std::string& my_host);

  int size() const { return static_cast<int>(host_of_rank_.size()); }
  int num_hosts() const { return num_hosts_; }
  int host_of(int rank) const { return host_of_rank_.at(rank); }
  bool same_host(int a, int b) const { return host_of(a) == host_of(b); }
  // Group ranks on the host of `rank`, increasing, `rank` included.
  const std::vector<int>& ranks_on_host_of(int rank) const { return ranks_on_host(host_of(rank)); }
  // Group ranks on host `host` (0 .. num_hosts-1), increasing.
  const std::vector<int>& ranks_on_host(int host) const { return ranks_by_host_.at(host); }
  // Whether every host has the same number of ranks.
  bool balanced() const { return balanced_; }

 private:
  std::vector<int> host_of_rank_;  // dense host index, numbered by first appearance
  int num_hosts_ = 0;
  // Derived once: the collectives ask on every call.
  std::vector<std::vector<int>> ranks_by_host_;
  bool balanced_ = true;
};

}  // namespace cgx::topology
