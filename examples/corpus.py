"""The main job's text: the docstrings of a fixed list of standard-library names, a fixed function of the Python
version.

The list below names each module and its public classes and functions one by one (portable ones: nothing that only
one platform defines), so the text does not depend on what else a process has imported: ``dir()`` of a package also
lists the submodules that other libraries happened to import, and a library may replace a standard-library function
(Lightning replaces ``warnings.formatwarning``, nest_asyncio ``asyncio.run``). :func:`corpus_text` therefore builds
the text in a fresh interpreter that sees the standard library only (``python -I -S``). A name this Python lacks is
left out, so another Python version gives another text; the same version gives the same text on every install.

    python examples/corpus.py          # print the text (what the fresh interpreter runs)
"""

from __future__ import annotations

import importlib
import inspect
import platform
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

# module -> its names, space-separated; each name's docstring (with more than 80 characters, once) in this order
CORPUS: Dict[str, str] = {
    "abc": (
        "ABCMeta abstractclassmethod abstractmethod abstractproperty abstractstaticmethod get_cache_token "
        "update_abstractmethods"
    ),
    "argparse": (
        "Action ArgumentDefaultsHelpFormatter ArgumentError ArgumentParser FileType HelpFormatter "
        "MetavarTypeHelpFormatter Namespace RawDescriptionHelpFormatter RawTextHelpFormatter"
    ),
    "ast": (
        "AsyncFunctionDef ClassDef FunctionDef MatchClass NodeTransformer NodeVisitor arguments "
        "copy_location dump expr fix_missing_locations get_docstring get_source_segment increment_lineno "
        "iter_child_nodes iter_fields literal_eval mod operator parse pattern stmt walk"
    ),
    "asyncio": (
        "Barrier BaseProtocol BoundedSemaphore BufferedProtocol Condition Event Future "
        "IncompleteReadError LimitOverrunError Lock PriorityQueue Protocol Queue Runner Semaphore "
        "SendfileNotAvailableError StreamReaderProtocol StreamWriter TaskGroup Timeout Transport "
        "as_completed create_task ensure_future gather get_event_loop get_running_loop isfuture "
        "open_connection run run_coroutine_threadsafe set_event_loop_policy shield start_server "
        "timeout timeout_at to_thread wait wait_for"
    ),
    "base64": (
        "a85decode a85encode b16decode b32decode b32hexdecode b64decode b64encode b85decode b85encode "
        "encodebytes standard_b64decode standard_b64encode urlsafe_b64decode urlsafe_b64encode"
    ),
    "bisect": "bisect bisect_left insort insort_left",
    "calendar": "Calendar LocaleHTMLCalendar TextCalendar monthcalendar",
    "codecs": (
        "BufferedIncrementalDecoder BufferedIncrementalEncoder Codec EncodedFile IncrementalDecoder "
        "IncrementalEncoder StreamReaderWriter StreamRecoder decode encode getdecoder getencoder "
        "getincrementaldecoder getincrementalencoder getreader getwriter iterdecode iterencode lookup "
        "lookup_error make_encoding_map make_identity_dict open register register_error unregister"
    ),
    "collections": "ChainMap Counter UserDict UserString defaultdict deque namedtuple",
    "concurrent.futures": "as_completed wait",
    "configparser": (
        "BasicInterpolation ConverterMapping DuplicateOptionError DuplicateSectionError "
        "ExtendedInterpolation InterpolationSyntaxError LegacyInterpolation"
    ),
    "contextlib": (
        "AsyncExitStack ExitStack aclosing asynccontextmanager closing contextmanager nullcontext "
        "redirect_stdout suppress"
    ),
    "copy": "copy deepcopy",
    "csv": "Dialect Sniffer field_size_limit get_dialect reader register_dialect unregister_dialect writer",
    "dataclasses": "asdict astuple dataclass field fields make_dataclass replace",
    "datetime": "datetime time timedelta",
    "decimal": "Context Decimal localcontext",
    "difflib": (
        "Differ HtmlDiff IS_CHARACTER_JUNK IS_LINE_JUNK SequenceMatcher context_diff diff_bytes "
        "get_close_matches ndiff restore unified_diff"
    ),
    "dis": "Bytecode Instruction dis findlabels findlinestarts get_instructions show_code",
    "doctest": (
        "DebugRunner DocFileCase DocFileSuite DocTest DocTestFailure DocTestFinder DocTestRunner "
        "DocTestSuite Example OutputChecker UnexpectedException debug run_docstring_examples "
        "script_from_examples set_unittest_reportflags testfile testmod testsource"
    ),
    "email": "message_from_binary_file message_from_bytes message_from_file message_from_string",
    "email.message": "Charset EmailMessage Policy",
    "email.utils": (
        "decode_params encode_rfc2231 format_datetime formataddr formatdate localtime make_msgid parseaddr quote"
    ),
    "enum": "Enum FlagBoundary bin global_enum global_enum_repr global_flag_repr property",
    "filecmp": "cmp cmpfiles dircmp",
    "fnmatch": "fnmatch fnmatchcase translate",
    "fractions": "Fraction",
    "ftplib": "FTP FTP_TLS parse150 parse227 parse229 parse257 test",
    "functools": ("lru_cache partial partialmethod reduce singledispatch singledispatchmethod update_wrapper wraps"),
    "getopt": "getopt gnu_getopt",
    "glob": "glob iglob",
    "graphlib": "CycleError",
    "gzip": "GzipFile compress open",
    "heapq": "heappushpop heapreplace merge nlargest nsmallest",
    "hmac": "HMAC digest new",
    "html.parser": "HTMLParser unescape",
    "http.client": "HTTPResponse parse_headers",
    "http.cookies": "Morsel SimpleCookie",
    "http.server": ("BaseHTTPRequestHandler CGIHTTPRequestHandler HTTPServer HTTPStatus SimpleHTTPRequestHandler test"),
    "inspect": (
        "BoundArguments FullArgSpec Parameter Signature classify_class_attrs cleandoc findsource "
        "formatargvalues get_annotations getabsfile getargs getargvalues getattr_static getcallargs "
        "getclasstree getclosurevars getcomments getcoroutinelocals getcoroutinestate getdoc "
        "getframeinfo getfullargspec getgeneratorlocals getgeneratorstate getinnerframes getmembers "
        "getmembers_static getouterframes getsource getsourcefile getsourcelines isasyncgenfunction "
        "isbuiltin isclass iscode iscoroutinefunction isdatadescriptor isframe isfunction isgenerator "
        "isgeneratorfunction isgetsetdescriptor ismemberdescriptor ismethod ismethoddescriptor "
        "ismodule istraceback unwrap"
    ),
    "io": (
        "BufferedRWPair BufferedRandom BufferedWriter FileIO IOBase IncrementalNewlineDecoder StringIO "
        "TextIOBase TextIOWrapper open open_code text_encoding"
    ),
    "ipaddress": (
        "IPv4Network IPv6Network collapse_addresses get_mixed_type_key ip_address ip_interface "
        "ip_network summarize_address_range v4_int_to_packed v6_int_to_packed"
    ),
    "itertools": (
        "chain combinations combinations_with_replacement compress count cycle dropwhile filterfalse "
        "groupby islice pairwise permutations product repeat starmap takewhile zip_longest"
    ),
    "json": "JSONDecodeError JSONDecoder JSONEncoder dump dumps load loads",
    "logging": (
        "Filter Formatter Handler LogRecord Logger LoggerAdapter Manager NullHandler PlaceHolder "
        "RootLogger StreamHandler addLevelName basicConfig captureWarnings critical debug error "
        "exception getLevelName getLogger info log makeLogRecord setLogRecordFactory setLoggerClass "
        "shutdown warning"
    ),
    "logging.handlers": (
        "BaseRotatingHandler BufferingHandler DatagramHandler MemoryHandler NTEventLogHandler "
        "QueueHandler QueueListener RotatingFileHandler SocketHandler SysLogHandler "
        "TimedRotatingFileHandler WatchedFileHandler"
    ),
    "mimetypes": "MimeTypes add_type guess_all_extensions guess_extension guess_type",
    "numbers": "Complex Integral Number Real",
    "optparse": "HelpFormatter Option OptionContainer OptionParser",
    "pathlib": "Path PosixPath PurePath PurePosixPath PureWindowsPath WindowsPath",
    "pickle": "Pickler Unpickler decode_long dump dumps encode_long load loads",
    "random": (
        "Random SystemRandom betavariate choices expovariate gammavariate gauss lognormvariate "
        "randrange sample seed triangular vonmisesvariate weibullvariate"
    ),
    "re": "Match error findall finditer fullmatch match search split sub subn",
    "secrets": "token_bytes token_hex token_urlsafe",
    "shutil": (
        "RegistryError SpecialFileError chown copy copy2 copyfile copymode copystat copytree disk_usage "
        "get_archive_formats get_terminal_size get_unpack_formats ignore_patterns make_archive move "
        "register_archive_format register_unpack_format rmtree unpack_archive which"
    ),
    "smtplib": (
        "LMTP SMTP SMTPAuthenticationError SMTPNotSupportedError SMTPRecipientsRefused "
        "SMTPResponseException SMTPSenderRefused SMTPServerDisconnected SMTP_SSL quoteaddr quotedata"
    ),
    "statistics": (
        "correlation covariance fmean geometric_mean harmonic_mean linear_regression mean median "
        "median_grouped median_high median_low mode multimode pstdev pvariance quantiles stdev "
        "variance"
    ),
    "string": "capwords",
    "struct": "iter_unpack pack pack_into unpack unpack_from",
    "subprocess": (
        "CalledProcessError CompletedProcess Popen TimeoutExpired call check_call check_output "
        "getoutput getstatusoutput list2cmdline run"
    ),
    "tarfile": "TarInfo calc_chksums copyfileobj is_tarfile open",
    "tempfile": ("NamedTemporaryFile SpooledTemporaryFile TemporaryDirectory TemporaryFile mkdtemp mkstemp mktemp"),
    "textwrap": "TextWrapper dedent fill indent shorten wrap",
    "threading": (
        "Barrier BoundedSemaphore Condition Event RLock Semaphore Thread Timer activeCount "
        "active_count currentThread current_thread enumerate main_thread setprofile settrace"
    ),
    "timeit": "Timer main",
    "tokenize": "detect_encoding generate_tokens tokenize untokenize",
    "traceback": (
        "FrameSummary TracebackException extract_stack extract_tb format_exception "
        "format_exception_only format_list print_exception print_last print_list print_stack "
        "print_tb walk_stack walk_tb"
    ),
    "types": "DynamicClassAttribute GenericAlias prepare_class",
    "typing": (
        "Annotated Any Generic IO NamedTuple NewType ParamSpec ParamSpecArgs ParamSpecKwargs Protocol "
        "TypeVar TypeVarTuple TypedDict assert_never assert_type cast dataclass_transform final "
        "get_args get_origin get_type_hints is_typeddict no_type_check no_type_check_decorator overload "
        "reveal_type runtime_checkable"
    ),
    "unittest": (
        "FunctionTestCase SkipTest TestLoader TestProgram TestResult TestSuite TextTestResult "
        "TextTestRunner addModuleCleanup doModuleCleanups"
    ),
    "urllib.parse": (
        "DefragResult ParseResult SplitResult parse_qs parse_qsl quote quote_from_bytes "
        "quote_plus unquote unquote_plus unwrap urldefrag urlencode urljoin urlparse urlsplit "
        "urlunparse urlunsplit"
    ),
    "urllib.request": (
        "HTTPDigestAuthHandler URLopener build_opener getproxies parse_http_list pathname2url "
        "proxy_bypass request_host url2pathname urlopen urlretrieve"
    ),
    "uuid": "UUID getnode uuid1",
    "warnings": "catch_warnings filterwarnings simplefilter",
    "weakref": "KeyedRef WeakKeyDictionary WeakMethod WeakValueDictionary finalize proxy",
    "xml.etree.ElementTree": (
        "C14NWriterTarget Comment ElementTree PI QName XML XMLID canonicalize dump "
        "fromstringlist indent iterparse parse register_namespace tostring"
    ),
    "zipfile": "CompleteDirs LargeZipFile Path ZipFile is_zipfile",
}


def build() -> str:
    """The text, from this process's standard library (as the fresh interpreter of :func:`corpus_text` runs it)."""
    parts: List[str] = []
    seen = set()
    for module_name, names in CORPUS.items():
        module = importlib.import_module(module_name)
        for obj in [module, *(getattr(module, name) for name in names.split() if hasattr(module, name))]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80 and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


def corpus_text() -> str:
    """The text, built in a fresh interpreter with the standard library only: the same for this Python version
    whatever this process imported or replaced."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-X", "utf8", str(Path(__file__).resolve())],
        capture_output=True,
        check=True,
    )
    return result.stdout.decode("utf-8")


def python_version() -> str:
    """The version the text is a function of: ``CPython 3.11.7``."""
    return f"{platform.python_implementation()} {platform.python_version()}"


if __name__ == "__main__":
    sys.stdout.write(build())
