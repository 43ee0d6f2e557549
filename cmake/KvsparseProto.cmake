# kvsparse_proto_library(<target> ROOT <dir> PROTOS <rel paths...> [DEPS <targets...>])
# Generates C++ protobuf + gRPC code for PROTOS (paths relative to ROOT, which is also the import
# root) into the build tree and builds it as a static library exporting the generated headers.
function(kvsparse_proto_library target)
  cmake_parse_arguments(ARG "" "ROOT" "PROTOS;DEPS" ${ARGN})
  set(out_dir ${CMAKE_CURRENT_BINARY_DIR}/gen)
  file(MAKE_DIRECTORY ${out_dir})
  get_target_property(grpc_plugin gRPC::grpc_cpp_plugin LOCATION)
  set(import_flags -I ${ARG_ROOT})
  foreach(dep ${ARG_DEPS})
    get_target_property(dep_root ${dep} KVSPARSE_PROTO_ROOT)
    list(APPEND import_flags -I ${dep_root})
  endforeach()
  set(srcs "")
  foreach(rel ${ARG_PROTOS})
    string(REGEX REPLACE "\\.proto$" "" stem ${rel})
    set(outs ${out_dir}/${stem}.pb.cc ${out_dir}/${stem}.pb.h ${out_dir}/${stem}.grpc.pb.cc
             ${out_dir}/${stem}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${outs}
      COMMAND protobuf::protoc ARGS --cpp_out=${out_dir} --grpc_out=${out_dir}
              --plugin=protoc-gen-grpc=${grpc_plugin} ${import_flags} ${rel}
      WORKING_DIRECTORY ${ARG_ROOT}
      DEPENDS ${ARG_ROOT}/${rel} protobuf::protoc
      COMMENT "protoc ${rel}")
    list(APPEND srcs ${outs})
  endforeach()
  add_library(${target} STATIC ${srcs})
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${out_dir}>
                                             $<INSTALL_INTERFACE:include>)
  target_link_libraries(${target} PUBLIC protobuf::libprotobuf gRPC::grpc++ ${ARG_DEPS})
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON
                                             KVSPARSE_PROTO_ROOT ${ARG_ROOT})
  string(REGEX REPLACE "^kvsparse_" "" export_name ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${export_name})
endfunction()
