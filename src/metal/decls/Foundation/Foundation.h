// NOT Apple's header. A stand-in declaring exactly the Foundation subset that src/metal/device.mm
// uses, written from Apple's Foundation documentation, for the Linux type check only
// (tools/metal_device_check.py: clang -fsyntax-only -x objective-c++ -fobjc-arc
// -fobjc-runtime=macosx-14.0 -I src/metal/decls). Never on an Apple build's include path: there
// <Foundation/Foundation.h> is the SDK's. What this check cannot prove is in docs/metal.md.
#pragma once
#include <stddef.h>
#include <stdint.h>

// 64-bit Apple platforms (LP64); BOOL is bool on arm64 macOS
typedef long NSInteger;
typedef unsigned long NSUInteger;
typedef bool BOOL;
#define YES __objc_yes
#define NO __objc_no
// <objc/objc.h>: nil is nullptr in C++11 and later
#define nil nullptr

#define NS_RETURNS_RETAINED __attribute__((ns_returns_retained))
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#define NS_OPTIONS(_type, _name) enum _name : _type _name; enum _name : _type
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type

#pragma clang assume_nonnull begin

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char *)nullTerminatedCString;
@property (nullable, readonly) const char *UTF8String NS_RETURNS_INNER_POINTER;
@end

typedef NSString *NSErrorDomain;

@interface NSError : NSObject
@property (readonly, copy) NSErrorDomain domain;
@property (readonly) NSInteger code;
@property (readonly, copy) NSString *localizedDescription;
@end

@interface NSArray<__covariant ObjectType> : NSObject
@property (readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end

#pragma clang assume_nonnull end
