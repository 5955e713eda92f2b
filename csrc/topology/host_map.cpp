#include "topology/host_map.h"

#include <map>

namespace cgx::topology {

HostMap::HostMap(std::vector<std::string> host_names) {
  std::map<std::string, int> index;
  host_of_rank_.reserve(host_names.size());
  for (const auto& name : host_names) {
    auto [it, inserted] = index.emplace(name, num_hosts_);
    if (inserted) ++num_hosts_;
    host_of_rank_.push_back(it->second);
  }
  ranks_by_host_.resize(num_hosts_);
  for (int r = 0; r < size(); ++r) ranks_by_host_[host_of_rank_[r]].push_back(r);
  for (const auto& ranks : ranks_by_host_)
    balanced_ = balanced_ && ranks.size() == ranks_by_host_.front().size();
}

HostMap HostMap::exchange(KeyValueStore& store, int rank, int size, const std::string& my_host) {
  store.set("host/" + std::to_string(rank), std::vector<uint8_t>(my_host.begin(), my_host.end()));
  std::vector<std::string> names;
  names.reserve(size);
  for (int r = 0; r < size; ++r) {
    auto bytes = store.get("host/" + std::to_string(r));
    names.emplace_back(bytes.begin(), bytes.end());
  }
  return HostMap(std::move(names));
}

}  // namespace cgx::topology
